"""Scoring functions that tests/e2e/test_generation_eval.py names in eval_generation.scorers (TRL's signature)."""


def length(prompts, completions, completion_ids, **columns):
    """Each completion's token count, and the columns it was handed checked against the prompts'."""
    assert len(columns["response"]) == len(prompts) == len(completions)
    return [float(len(ids)) for ids in completion_ids]


def unscored(prompts, completions, completion_ids, **columns):
    return [None] * len(completions)


def raises(prompts, completions, completion_ids, **columns):
    raise ValueError("no answer key")


def one_short(prompts, completions, completion_ids, **columns):
    return [1.0] * (len(completions) - 1)
