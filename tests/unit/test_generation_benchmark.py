"""benchmarks/generation.py documents every option in --help. Its runs are by hand (docs/generation.md#measured):
a --quick run costs the suite a launch of torchrun, and what it would check of the engine (the tokens of
transformers' generate, the all-gathers of a phase) tests/dist/test_generation_ranks.py holds."""

from pathlib import Path

from tests.helpers import undocumented_options

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "generation.py"


def test_help_documents_every_option():
    assert not undocumented_options(SCRIPT)
