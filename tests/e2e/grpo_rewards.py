"""Reward functions that tests/e2e/test_grpo_run.py names in grpo.reward_funcs (TRL's signature)."""

from llmtune.generation.scorers import completion_text


def digits(prompts, completions, completion_ids, **columns):
    """How many digits a completion holds, the columns it was handed checked against the prompts'."""
    assert len(columns["solution"]) == len(prompts) == len(completions)
    return [float(sum(ch.isdigit() for ch in completion_text(c))) for c in completions]


def raises(prompts, completions, completion_ids, **columns):
    raise ValueError("no answer key")


def one_short(prompts, completions, completion_ids, **columns):
    return [1.0] * (len(completions) - 1)


def words(prompts, completions, completion_ids, **columns):
    return ["many"] * len(completions)
