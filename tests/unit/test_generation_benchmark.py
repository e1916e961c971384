"""benchmarks/generation.py documents every option in --help, and its --quick run (tiny sizes, 1 process) exits 0
and writes every figure: the engine's and transformers' completions/s, the same tokens from both with greedy
decoding, and the all-gathers at two lengths. No figure of speed is judged here."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import undocumented_options

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "generation.py"


def test_help_documents_every_option():
    assert not undocumented_options(SCRIPT)


@pytest.mark.slow
def test_quick_run_writes_every_figure(tmp_path):
    """One process only: the 2-process all-gathers are tests/dist/test_generation_ranks.py's, and a second launch
    would cost the suite another 20 s."""
    out = tmp_path / "generation.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--nproc", "1", "--out",
                           str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    figures = json.loads(out.read_text())["figures"]
    one = figures["one_process"]
    assert one["engine_completions_per_s"] > 0 and one["hf_completions_per_s"] > 0 and one["engine_over_hf"] > 0
    assert one["same_tokens"] == 1.0, "greedy decoding of the same weights chooses the same tokens"
    assert {row["all_gathers"] for row in figures["all_gathers"]["1"]["by_max_new_tokens"].values()} == {0}
    assert "engine / HF" in done.stdout
