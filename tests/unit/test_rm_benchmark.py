"""benchmarks/rm.py documents every option in --help; each of its TRL contenders runs in turn with llmtune and alone. TRL is never run here
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


def test_every_trl_contender_runs_in_turn_with_llmtune_and_alone(benchmark):
    runners = list(benchmark.CONTENDERS.values())
    for trl in benchmark.TRL_SETTINGS:
        assert (trl, benchmark.LLMTUNE) in runners and (trl,) in runners
    assert (benchmark.LLMTUNE,) in runners
    # llmtune's steps beside each TRL contender are told apart in the results.
    assert len({benchmark.beside(trl) for trl in benchmark.TRL_SETTINGS}) == len(benchmark.TRL_SETTINGS)
