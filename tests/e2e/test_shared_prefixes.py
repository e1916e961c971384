"""dpo, kto and grpo with a row's prompt computed once (data/collate.share_prefix: the second sequence a branch of the
first, from the prompt's last token, which predicts its first response token) against every sequence whole (the
features' vote turned off): fewer tokens a step, and the same per-step losses, gradient norms and metrics (fp32,
1e-5 relative; the values that start at 0, the rewards and their margins, also absolute, at the log-probabilities'
scale), for every dpo loss, with a precomputed reference, and for kto; grpo's completions of a prompt in one
micro-batch branches of its first, for every loss type, GSPO, a KL term and a round trained twice (the old policy's
log-probabilities computed on the shared rows too). (Two processes and cp=2 against whole sequences on one:
tests/dist/test_dpo_ranks.py, tests/dist/test_grpo_ranks.py.)"""

import pytest

import llmtune
from llmtune.config import PREFERENCE_LOSSES
from tests.helpers import near, read_metrics

COMPARED = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
            "logps/chosen", "logps/rejected", "kl")
GRPO_COMPARED = ("loss", "grad_norm", "reward", "reward_std", "completions/mean_length", "entropy",
                 "clip_ratio/region_mean", "kl")


def recipe(model, data, out, task_section: dict) -> dict:
    return {"model": {"name_or_path": model},
            "data": {"train_files": [data], "chat_template": "basic", "max_seq_len": 128, "shuffle": False},
            "train": {"output_dir": out, "max_steps": 2, "per_device_train_batch_size": 2, "global_batch_size": 4,
                      "logging_steps": 1, "learning_rate": 2e-3},
            "checkpoint": {"export_hf": False}, "monitor": {"plots": False}, **task_section}


def shared_and_whole(task: str, sections: dict, tmp_path, monkeypatch) -> tuple[list[dict], list[dict]]:
    from llmtune.features.base import Features

    llmtune.train(task, {**sections, "train": {**sections["train"], "output_dir": str(tmp_path / "shared")}})
    with monkeypatch.context() as patched:
        patched.setattr(Features, "keep_shared_prefixes", lambda self: False)
        llmtune.train(task, {**sections, "train": {**sections["train"], "output_dir": str(tmp_path / "whole")}})
    return [[r for r in read_metrics(tmp_path / name) if "loss" in r] for name in ("shared", "whole")]


def assert_same(shared: list[dict], whole: list[dict]) -> None:
    assert len(shared) == len(whole) == 2
    scale = max(abs(r[key]) for r in whole for key in ("logps/chosen", "logps/rejected") if key in r)
    for a, b in zip(shared, whole):
        keys = [key for key in COMPARED if key in b]
        assert [key for key in COMPARED if key in a] == keys and {"loss", "grad_norm"} <= set(keys)
        assert [a[key] for key in keys] == near([b[key] for key in keys], scale), keys
    # The prompts computed once: fewer tokens through the model.
    assert sum(r["input_tokens"] for r in shared) < 0.8 * sum(r["input_tokens"] for r in whole)


@pytest.mark.parametrize("loss", PREFERENCE_LOSSES)
def test_dpo_with_shared_prompts_trains_as_with_whole_sequences(tiny_model, pairs_file, tmp_path, monkeypatch, loss):
    sections = recipe(str(tiny_model), str(pairs_file), str(tmp_path), {"dpo": {"loss_type": [loss]}})
    assert_same(*shared_and_whole("dpo", sections, tmp_path, monkeypatch))


def test_a_precomputed_reference_is_computed_on_the_shared_rows_too(tiny_model, pairs_file, tmp_path, monkeypatch):
    sections = recipe(str(tiny_model), str(pairs_file), str(tmp_path), {"dpo": {"reference": "precomputed"}})
    assert_same(*shared_and_whole("dpo", sections, tmp_path, monkeypatch))


def test_kto_with_shared_prompts_trains_as_with_whole_sequences(tiny_model, examples_file, tmp_path, monkeypatch):
    sections = recipe(str(tiny_model), str(examples_file), str(tmp_path), {})
    assert_same(*shared_and_whole("kto", sections, tmp_path, monkeypatch))


@pytest.mark.parametrize("grpo", [{"loss_type": "grpo"}, {"loss_type": "bnpo", "beta": 0.1, "num_iterations": 2},
                                  {"loss_type": "dr_grpo", "importance_sampling_level": "sequence", "beta": 0.1},
                                  {"loss_type": "dapo"}], ids=["grpo", "bnpo_kl_twice", "dr_grpo_gspo", "dapo"])
def test_grpo_with_shared_prompts_trains_as_with_whole_sequences(tiny_model, grpo_prompts_file, tmp_path, monkeypatch,
                                                                 grpo):
    sections = {"model": {"name_or_path": str(tiny_model)},
                "data": {"train_files": [str(grpo_prompts_file)], "chat_template": "basic", "max_seq_len": 64},
                "train": {"max_steps": 2, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                          "logging_steps": 1, "learning_rate": 1e-2},
                "checkpoint": {"export_hf": False}, "monitor": {"plots": False},
                "grpo": {"reward_funcs": ["tests.e2e.grpo_rewards:digits"], "num_generations": 4,
                         "max_completion_length": 6, "temperature": 1.5, **grpo}}
    shared, whole = shared_and_whole("grpo", sections, tmp_path, monkeypatch)
    assert len(shared) == len(whole) == 2
    for a, b in zip(shared, whole):
        keys = [key for key in GRPO_COMPARED if key in b]
        assert ("kl" in keys) == ("beta" in grpo)
        # The loss at importance ratio 1 is near 0 (a mean advantage): absolute too, at the rewards' scale.
        assert [a[key] for key in keys] == near([b[key] for key in keys], 1.0), keys
    assert sum(r["input_tokens"] for r in shared) < 0.8 * sum(r["input_tokens"] for r in whole)
