"""llmtune dpo on one process: at step 0, where the policy is its reference, every reference mode gives rewards of
exactly 0 and the sigmoid loss ln 2; the per-step losses do not depend on how many rows (holding 1, 2 or 3 pairs
each) a micro-batch takes; the run exports, resumes bitwise and evaluates on preference data with TRL's metric
names. (Two processes and context parallelism: tests/dist/test_dpo_ranks.py.)"""

import math

import pytest

import llmtune
from tests.helpers import StopAt, add_to_hub_cache, read_metrics

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def recipe(model, pairs, out, train=None, **sections) -> dict:
    return {
        "model": {"name_or_path": model},
        "data": {"train_files": [pairs], "chat_template": "basic", "max_seq_len": 128, "shuffle": False},
        "train": {"output_dir": out, "max_steps": 3, "per_device_train_batch_size": 1, "global_batch_size": 4,
                  "logging_steps": 1, "learning_rate": 2e-3, "per_device_eval_batch_size": 1, **(train or {})},
        "checkpoint": {"export_hf": False},
        "monitor": {"plots": False},
        **sections,
    }


@pytest.mark.parametrize("reference, peft", [("model", {}), ("adapter_off", {"method": "lora", "r": 4}),
                                             ("precomputed", {})])
def test_every_reference_gives_no_reward_and_ln2_at_step_zero(tiny_model, pairs_file, tmp_path, reference, peft):
    out = tmp_path / reference
    llmtune.train("dpo", recipe(tiny_model, pairs_file, out, train={"max_steps": 1}, dpo={"reference": reference},
                                peft=peft or {"method": "none"}))
    first = read_metrics(out)[0]
    assert abs(first["loss"] - math.log(2)) < 1e-6
    assert first["rewards/chosen"] == first["rewards/rejected"] == first["rewards/margins"] == 0.0
    assert first["rewards/accuracies"] == 0.5
    assert first["pairs_per_s"] > 0 and first["logps/chosen"] < 0


def test_the_losses_do_not_depend_on_how_many_rows_a_micro_batch_takes(tiny_model, pairs_file, tmp_path):
    runs = {}
    for micro in (1, 2, 4):
        out = tmp_path / f"micro{micro}"
        llmtune.train("dpo", recipe(tiny_model, pairs_file, out, train={"per_device_train_batch_size": micro}))
        runs[micro] = [r["loss"] for r in read_metrics(out) if "loss" in r]
    assert len(runs[1]) == 3
    # A micro-batch's pairs are packed into rows of 128 tokens, holding 1, 2 or 3 pairs each, so the micro-batches of
    # one step hold different numbers of rows and tokens: averaging each micro-batch's pairs, or rows, would weigh
    # them differently in each layout.
    log = (tmp_path / "micro1" / "train.log").read_text()
    assert "48 pairs, each micro-batch's packed into one row" in log
    # The banner counts the pairs a step trains, as TRL and LLaMA-Factory count them.
    assert "start: 48 pairs, 0.25 epochs of 12 steps = 3 optimizer steps" in log
    assert "start: global batch 4 pairs = micro-batch 1 x accumulation 4 x 1 data-parallel" in log
    for micro in (2, 4):
        assert runs[micro] == pytest.approx(runs[1], rel=1e-5)


@pytest.mark.parametrize("reference, peft", [("model", {}), ("precomputed", {}),
                                             ("adapter_off", {"method": "lora", "r": 4})])
def test_a_resumed_run_repeats_the_uninterrupted_one_bitwise_and_exports(tiny_model, pairs_file, tmp_path, reference,
                                                                         peft):
    """Also: the precomputed values are read back from the cache by the resume, and an adapter run exports its
    adapter."""
    sections = {"dpo": {"reference": reference}, "peft": peft or {"method": "none"},
                "checkpoint": {"save_steps": 2, "export_dtype": "fp32"}}
    whole, part = tmp_path / "whole", tmp_path / "part"
    llmtune.train("dpo", recipe(tiny_model, pairs_file, whole, train={"max_steps": 4}, **sections))
    llmtune.train("dpo", recipe(tiny_model, pairs_file, part, train={"max_steps": 4}, **sections),
                  callbacks=[StopAt(2)])
    llmtune.train("dpo", recipe(tiny_model, pairs_file, part, train={"max_steps": 4}, **sections),
                  resume_from_checkpoint="auto")
    expected, got = ([(r["step"], r["loss"], r["rewards/margins"]) for r in read_metrics(out) if "loss" in r]
                     for out in (whole, part))
    assert len(expected) == 4 and got == expected
    if reference == "precomputed":
        assert "log-probabilities read from" in (part / "train.log").read_text()
    exported = "adapter" if peft else "hf"
    assert (whole / exported / ("adapter_model.safetensors" if peft else "model.safetensors")).is_file()


def test_a_reference_of_other_weights_gives_rewards_from_the_first_step(tiny_model, tiny_qwen2, pairs_file, tmp_path):
    """dpo.ref_model names the reference's weights: another model's log-probabilities, so the first step's rewards
    are not 0. Also: the console's line shows the margin and accuracy, the result carries the task's metrics."""
    out = tmp_path / "other"
    result = llmtune.train("dpo", recipe(tiny_model, pairs_file, out, train={"max_steps": 1},
                                         dpo={"ref_model": str(tiny_qwen2)}))
    first = read_metrics(out)[0]
    assert first["rewards/chosen"] != 0.0 and abs(first["loss"] - math.log(2)) > 1e-3
    assert (f"step 1/1 epoch {first['epoch']:.2f} loss {first['loss']:.4f} rewards/margins "
            f"{first['rewards/margins']:.4f} rewards/accuracies {first['rewards/accuracies']:.4f} lr ") \
        in (out / "train.log").read_text()
    assert result.metrics == {name: first[name] for name in METRICS} and result.eval_metrics == {}


def test_a_mixture_of_experts_adds_its_router_loss_over_the_labelled_tokens(assets, pairs_file, tmp_path):
    """A tiny Qwen3-MoE from its config: at step 0 the loss is ln 2 plus the router's coefficient times its
    token-weighted aux loss, which the record reports with the expert load."""
    from transformers import Qwen3MoeConfig

    tokenizer = assets / "tokenizer"
    Qwen3MoeConfig(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                   num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=8, max_position_embeddings=256, router_aux_loss_coef=0.3).save_pretrained(tmp_path / "moe")
    out = tmp_path / "out"
    run = recipe(None, pairs_file, out, train={"max_steps": 1})
    run["model"] = {"config": str(tmp_path / "moe"), "tokenizer": str(tokenizer)}
    llmtune.train("dpo", run)
    first = read_metrics(out)[0]
    assert first["aux_loss"] > 0 and first["expert_load"] >= 1.0
    assert first["loss"] == pytest.approx(math.log(2) + 0.3 * first["aux_loss"], rel=1e-5)
    assert first["rewards/margins"] == 0.0


def test_pairs_of_a_hub_dataset_train_by_its_name(tiny_model, pairs_file, tmp_path, monkeypatch):
    """An offline Hub cache the test lays out: org/pairs, read by its name as any data source."""
    import datasets
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    add_to_hub_cache(tmp_path, "org/pairs", "dataset", pairs_file.parent, "e" * 40, refs=("main",))
    out = tmp_path / "out"
    llmtune.train("dpo", recipe(tiny_model, "org/pairs", out, train={"max_steps": 1}))
    first = read_metrics(out)[0]
    assert abs(first["loss"] - math.log(2)) < 1e-6 and "48 pairs" in (out / "train.log").read_text()
