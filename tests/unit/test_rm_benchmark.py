"""benchmarks/rm.py documents every option in --help; its llmtune side takes about --batch pairs a step, every pair
whole, as the docstring says; each of its TRL contenders runs in turn with llmtune and alone. TRL is never run here
(its runs are by hand, docs/benchmarks.md)."""

from pathlib import Path

import pytest

from tests.helpers import script_module, undocumented_options

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "rm.py"


@pytest.fixture(scope="module")
def benchmark():
    return script_module(SCRIPT)


def test_help_documents_every_option():
    assert not undocumented_options(SCRIPT)


@pytest.mark.parametrize("batch", [4, 8, 16])
def test_llmtune_takes_about_batch_pairs_a_step(benchmark, batch):
    # Pairs of 72-236 tokens, as the default workload's: rows of 1024 hold several, whole.
    pair_tokens = [72 + (37 * i) % 165 for i in range(128)]
    rows, pairs = benchmark.llmtune_rows(pair_tokens, batch, 1024)
    assert rows >= 1
    assert abs(pairs - batch) <= pairs / rows / 2  # the nearest whole number of rows


def test_a_step_has_a_row_at_least(benchmark):
    rows, pairs = benchmark.llmtune_rows([500] * 16, 1, 4096)
    assert rows == 1 and pairs == pytest.approx(8)  # 8 pairs fill a row; a step takes the row


def test_every_trl_contender_runs_in_turn_with_llmtune_and_alone(benchmark):
    runners = list(benchmark.CONTENDERS.values())
    for trl in benchmark.TRL_SETTINGS:
        assert (trl, benchmark.LLMTUNE) in runners and (trl,) in runners
    assert (benchmark.LLMTUNE,) in runners
    # llmtune's steps beside each TRL contender are told apart in the results.
    assert len({benchmark.beside(trl) for trl in benchmark.TRL_SETTINGS}) == len(benchmark.TRL_SETTINGS)
