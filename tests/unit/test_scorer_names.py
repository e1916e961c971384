"""Scorers' names in the metrics (rewards/NAME/mean, eval_gen/NAME): a reward model by its folder's name, an llmtune
export (output_dir/hf, hf_ema) by its run's folder and its own, so that two runs' exports are told apart; a name
given twice is refused in one line."""

import pytest

from llmtune.errors import UserError
from llmtune.generation.scorers import load_scorers


def model_folder(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")  # read when it first scores: never here
    return str(path)


def test_reward_models_are_named_so_that_two_exports_differ(tmp_path):
    folders = [model_folder(tmp_path / "rm_small" / "hf"), model_folder(tmp_path / "rm_large" / "hf_ema"),
               model_folder(tmp_path / "OpenRM-8B")]
    names = [scorer.name for scorer in load_scorers([*folders, "numeric_match"], "solution", None, "grpo.reward_funcs")]
    assert names == ["rm_small-hf", "rm_large-hf_ema", "OpenRM-8B", "numeric_match"]


def test_a_name_given_twice_is_refused(tmp_path):
    folders = [model_folder(tmp_path / "a" / "rm"), model_folder(tmp_path / "b" / "rm")]
    with pytest.raises(UserError, match=r"^grpo.reward_funcs: rm named twice: each scorer's metrics"):
        load_scorers(folders, "solution", None, "grpo.reward_funcs")
