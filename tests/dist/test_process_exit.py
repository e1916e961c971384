"""A rank whose last collective ends while its process exits: as a plain Python program it aborts (the test's
control: gloo's worker thread takes the GIL during the interpreter's finalization); ending through
process_exit.run_and_exit, as every llmtune process does, it exits 0."""

import subprocess
import sys

from tests.helpers import REPO

WORKER = REPO / "tests" / "dist" / "exit_race_worker.py"


def rank_0_exit_code(mode: str, tmp_path) -> tuple[int, str]:
    store = tmp_path / f"store_{mode}"
    ranks = [subprocess.Popen([sys.executable, str(WORKER), str(rank), str(store), mode], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [rank.communicate(timeout=120)[0] for rank in ranks]
    return ranks[0].returncode, outputs[0]


def test_a_collective_ending_during_exit_aborts_a_plain_process_but_not_an_llmtune_one(tmp_path):
    code, output = rank_0_exit_code("plain", tmp_path)
    assert code == -6 and "terminate called without an active exception" in output, (code, output)
    code, output = rank_0_exit_code("llmtune", tmp_path)
    assert code == 0, output
