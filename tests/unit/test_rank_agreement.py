"""The fingerprints every rank compares with rank 0's before the first step, and the message when one differs."""

from llmtune.config import load_config
from llmtune.run.rank_agreement import first_difference, recipe_fingerprints


def recipe(tmp_path, *overrides: str, world_size: int = 1):
    return load_config({"model": {"name_or_path": "m"}, "data": {"train_files": ["d.jsonl"]},
                        "train": {"output_dir": str(tmp_path), "global_batch_size": 32}},
                       list(overrides), "sft", world_size)


def test_the_recipe_fingerprint_leaves_out_what_the_number_of_ranks_derives(tmp_path):
    one, two = recipe(tmp_path), recipe(tmp_path, world_size=2)
    assert one.train.gradient_accumulation_steps != two.train.gradient_accumulation_steps
    assert recipe_fingerprints(one) == recipe_fingerprints(two)
    changed = recipe_fingerprints(recipe(tmp_path, "train.learning_rate=1e-3"))
    assert [key for key in changed if changed[key] != recipe_fingerprints(one)[key]] == ["train.learning_rate"]


def test_the_first_key_that_differs_from_rank_0_is_named_with_the_first_rank_that_differs():
    same = {"task": "a", "train.learning_rate": "b", "data (training)": "c", "model": "d"}
    assert first_difference([same, dict(same), dict(same)]) is None
    other_model = {**same, "model": "x"}
    other_lr = {**same, "train.learning_rate": "y", "model": "x"}
    assert first_difference([same, other_model, other_lr]) == (
        "train.learning_rate differs between ranks: rank 2 has another value than rank 0 (check that every node "
        "reads the same recipe)")
    assert first_difference([same, other_model]) == (
        "model differs between ranks: rank 1 has another value than rank 0 (check that every node reads the same "
        "model folder)")
    assert first_difference([same, {**same, "data (training)": "z"}]).startswith(
        "data (training) differs between ranks: rank 1")
