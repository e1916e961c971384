"""benchmarks/preference.py's pairs: the same for a seed, in TRL's conversational form, of skewed lengths (what the
comparison with TRL's padded batches is about), and its sft samples the pairs' own sequences. TRL is never run
here."""

import statistics
from pathlib import Path

import pytest

from tests.helpers import script_module

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "preference.py"


@pytest.fixture(scope="module")
def benchmark():
    return script_module(SCRIPT)


def words(message: list[dict]) -> int:
    return len(message[0]["content"].split())


def test_pairs_are_deterministic_and_conversational(benchmark):
    pairs = benchmark.preference_pairs(64, seed=3)
    assert pairs == benchmark.preference_pairs(64, seed=3)
    assert pairs != benchmark.preference_pairs(64, seed=4)
    assert {tuple(m["role"] for m in pair["prompt"] + pair["chosen"] + pair["rejected"]) for pair in pairs} == \
        {("user", "assistant", "assistant")}


def test_pair_lengths_are_skewed(benchmark):
    pairs = benchmark.preference_pairs(256)
    lengths = benchmark.LENGTHS
    for part in ("prompt", "chosen", "rejected"):
        counts = [words(pair[part]) for pair in pairs]
        # The whole clipped range is drawn: the longest 10x the shortest, and a long tail (mean above median).
        assert (min(counts), max(counts)) == (lengths["shortest"], lengths["longest"])
        assert statistics.mean(counts) > 1.1 * statistics.median(counts)
    # Chosen and rejected are drawn apart: within a pair the longer is often twice the shorter, which padding to the
    # longest pays for and packing does not.
    within = [max(words(p["chosen"]), words(p["rejected"])) / min(words(p["chosen"]), words(p["rejected"]))
              for p in pairs]
    assert sum(ratio >= 2 for ratio in within) > len(pairs) / 4


def test_length_scale_multiplies_every_word_count(benchmark):
    short, long = benchmark.preference_pairs(32, scale=1.0), benchmark.preference_pairs(32, scale=2.0)
    for a, b in zip(short, long):
        assert [2 * words(a[part]) for part in ("prompt", "chosen", "rejected")] == \
            [words(b[part]) for part in ("prompt", "chosen", "rejected")]


def test_sft_samples_are_the_pairs_sequences(benchmark):
    pairs = benchmark.preference_pairs(8)
    samples = benchmark.sft_samples(pairs)
    assert samples == [{"messages": pair["prompt"] + pair[answer]} for pair in pairs
                       for answer in ("chosen", "rejected")]
