"""benchmarks/generation.py documents every option in --help, and its --quick run (tiny sizes, 1 and 2 processes)
exits 0 and writes every figure: the engine's and transformers' completions/s, the same tokens from both with
greedy decoding, and the all-gathers at two lengths. No figure of speed is judged here."""

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
    out = tmp_path / "generation.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    figures = json.loads(out.read_text())["figures"]
    one, two = figures["one_process"], figures["two_processes"]
    assert one["engine_completions_per_s"] > 0 and one["hf_completions_per_s"] > 0 and one["engine_over_hf"] > 0
    assert one["same_tokens"] == 1.0, "greedy decoding of the same weights chooses the same tokens"
    assert two["engine_completions_per_s"] > 0
    gathers = figures["all_gathers"]
    assert {row["all_gathers"] for row in gathers["1"]["by_max_new_tokens"].values()} == {0}
    assert {row["all_gathers"] for row in gathers["2"]["by_max_new_tokens"].values()} == \
        {gathers["2"]["sharded_units"]}
    assert "engine / HF" in done.stdout
