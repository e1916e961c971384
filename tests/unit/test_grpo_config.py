"""grpo's recipe section: TRL 1.16's GRPOConfig names and defaults, TRL's booleans for scale_rewards, and the
refusals of a recipe grpo cannot train, each with the key and the fix."""

import pytest

from llmtune.config import GRPOConfig, load_config
from llmtune.errors import UserError

# TRL 1.16.0's GRPOConfig defaults (trl/trainer/grpo_config.py) of the keys llmtune reads.
TRL_DEFAULTS = {"num_generations": 8, "max_completion_length": 512, "generation_batch_size": None,
                "steps_per_generation": None, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": None,
                "repetition_penalty": 1.0, "loss_type": "dapo", "scale_rewards": "group", "epsilon": 0.2,
                "epsilon_high": None, "importance_sampling_level": "token", "num_iterations": 1, "beta": 0.0,
                "use_bias_correction_kl": True, "mask_truncated_completions": False, "reward_weights": None,
                "disable_dropout": False}


def test_the_defaults_are_trls():
    cfg = GRPOConfig()
    assert {key: getattr(cfg, key) for key in TRL_DEFAULTS} == TRL_DEFAULTS
    assert cfg.clip_high == 0.2 and not cfg.needs_reference()


@pytest.mark.parametrize("given, read", [(True, "group"), (False, "none"), ("batch", "batch")])
def test_scale_rewards_reads_trls_booleans(tmp_path, given, read):
    config = load_config(recipe(tmp_path), [f"grpo.scale_rewards={str(given).lower()}"], "grpo", 1)
    assert config.grpo.scale_rewards == read


def recipe(tmp_path, **grpo) -> dict:
    return {"model": {"name_or_path": str(tmp_path)}, "data": {"train_files": ["prompts.jsonl"]},
            "train": {"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 4,
                      "gradient_accumulation_steps": 2},
            "grpo": {"reward_funcs": ["accuracy"], **grpo}}


@pytest.mark.parametrize("grpo, world, said", [
    ({"num_generations": 1}, 1, "grpo.num_generations: 1 must be at least 2"),
    ({"generation_batch_size": 16, "steps_per_generation": 2}, 1,
     "grpo.generation_batch_size: set it or grpo.steps_per_generation, not both"),
    ({"reward_weights": [1.0, 2.0]}, 1, "grpo.reward_weights: 2 weights for 1 reward functions"),
    ({"reward_funcs": []}, 1, "grpo.reward_funcs: name at least one reward function"),
    ({"loss_type": "cispo"}, 1, "grpo.loss_type: 'cispo'"),
    ({"num_generations": 3}, 2, "grpo.generation_batch_size: a round of 16 completions is not a whole number of "
                                "groups of num_generations=3"),
    ({"generation_batch_size": 12, "num_generations": 4}, 1, "grpo.generation_batch_size: a round of 12 "
                                                             "completions is not a whole number of optimizer steps "
                                                             "of 8"),
    ({"beta": 0.1, "reference": "adapter_off"}, 1, "grpo.reference: adapter_off is the policy with its adapters "
                                                   "off, and this run trains no adapters"),
])
def test_a_recipe_grpo_cannot_train_is_refused_naming_the_key(tmp_path, grpo, world, said):
    with pytest.raises(UserError) as raised:
        load_config(recipe(tmp_path, **grpo), [], "grpo", world)
    assert said in str(raised.value)


def test_validation_data_is_refused_for_the_evaluation_by_generation(tmp_path):
    given = recipe(tmp_path)
    given["data"]["val_files"] = ["held_out.jsonl"]
    with pytest.raises(UserError, match="data.val_files: grpo has no validation or test loss; measure held-out "
                                        "prompts with eval_generation.files"):
        load_config(given, [], "grpo", 1)
