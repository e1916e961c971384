"""Loss parallel under sequence parallelism (tests/dist/loss_parallel_worker.py, 2 processes, gloo, fp32): the chunked
loss (soft-capped, label smoothing, z-loss, a bias) and the log-probabilities and entropies at a temperature, computed
on each rank's half of the rows' tokens and its half of the vocabulary, equal the same computed whole, with their
gradients w.r.t. the hidden states, the weight and the bias (1e-5 of the largest entry); rows of an odd length, which
do not split evenly, are computed gathered whole. The memory it saves is benchmarks/tensor_parallel.py's to measure."""

import json
import subprocess
import sys

import pytest

from tests.dist.loss_parallel_worker import CASES
from tests.helpers import REPO


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("loss_parallel")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             "-m", "tests.dist.loss_parallel_worker", str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in (out / "reports.jsonl").read_text().splitlines()]


def close(got: list[float], expected: list[float], what: str) -> None:
    scale = max(abs(value) for value in expected)
    assert scale > 0, what
    assert got == pytest.approx(expected, rel=0, abs=1e-5 * scale), what


@pytest.mark.parametrize("case", CASES)
def test_split_hidden_states_and_vocabulary_give_the_whole_loss_and_gradients(reports, case):
    mine = [report for report in reports if report["case"] == case]
    assert sorted(report["rank"] for report in mine) == [0, 1]
    for report in mine:
        expected, split = report["expected"], report["split"]
        assert split["loss"][0] == pytest.approx(expected["loss"][0], rel=1e-5)
        for key in ("logps", "entropy"):
            close(split[key], expected[key], key)
        for key in ("loss_grads", "logps_grads"):
            for part, (got, want) in enumerate(zip(split[key], expected[key])):
                close(got, want, f"{key}[{part}]")
