"""benchmarks/grpo.py documents every option in --help; its prompts are the same for a seed, in TRL's prompt-only
conversational form with the solution the reward compares with; its reward has TRL's signature and scores a
completion in either of TRL's forms. TRL is never run here (its runs are by hand, docs/benchmarks.md)."""

import re
from pathlib import Path

import pytest

from tests.helpers import script_module, undocumented_options

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "grpo.py"


@pytest.fixture(scope="module")
def benchmark():
    return script_module(SCRIPT)


def test_help_documents_every_option():
    assert not undocumented_options(SCRIPT)


@pytest.mark.parametrize("workload, roles", [("short", ("user",)), ("gsm8k-shaped", ("system", "user"))])
def test_prompts_are_deterministic_and_conversational(benchmark, workload, roles):
    shape = benchmark.WORKLOADS[workload]
    rows = benchmark.grpo_prompts(32, shape, seed=3)
    assert rows == benchmark.grpo_prompts(32, shape, seed=3)
    assert rows != benchmark.grpo_prompts(32, shape, seed=4)
    assert {tuple(row) for row in rows} == {("prompt", "solution")}
    assert {tuple(m["role"] for m in row["prompt"]) for row in rows} == {roles}
    # One system message for every question: the prompts of a real run share it.
    assert len({row["prompt"][0]["content"] for row in rows}) == (1 if "system" in roles else len(rows))


@pytest.mark.parametrize("workload", ["short", "gsm8k-shaped"])
def test_each_solution_is_the_sum_asked_for(benchmark, workload):
    low, high = benchmark.OPERANDS
    shape = benchmark.WORKLOADS[workload]
    shortest, longest = shape["question_words"] or (benchmark.LENGTHS["shortest"], benchmark.LENGTHS["longest"])
    for row in benchmark.grpo_prompts(64, shape):
        context, a, b = re.fullmatch(r"(.+)\. What is (\d+) \+ (\d+)\?", row["prompt"][-1]["content"]).groups()
        assert low <= int(a) <= high and low <= int(b) <= high
        assert row["solution"] == str(int(a) + int(b))
        assert shortest <= len(context.split()) <= longest


def test_reward_counts_digits_and_the_solution(benchmark):
    completions = ["12 + 30 = 42", "12 + 30 = 43", "no number", "", "42, not 7"]
    rewards = benchmark.digits(prompts=[None] * 5, completions=completions, completion_ids=[[]] * 5,
                               solution=["42"] * 5, trainer_state=None)
    assert rewards == [6 / 12 + 1, 6 / 12, 0.0, 0.0, 3 / 9]  # the last number is the answer
    # TRL's conversational form: the assistant's message, scored as its text.
    messages = [[{"role": "assistant", "content": text}] for text in completions]
    assert benchmark.digits(prompts=[None] * 5, completions=messages, completion_ids=[[]] * 5,
                            solution=["42"] * 5) == rewards


def test_reward_is_named_by_its_module(benchmark):
    # llmtune imports it as grpo.reward_funcs names it, with benchmarks/ on sys.path.
    module, _, function = benchmark.REWARD.partition(":")
    assert module == SCRIPT.stem and getattr(benchmark, function) is benchmark.digits
