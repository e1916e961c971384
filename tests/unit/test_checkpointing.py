"""train.gradient_checkpointing's modes (model/checkpointing.py) on a tiny Llama: none, full and selective give the
same loss and gradients (fp32, 1e-6); full runs each layer's attention and matmuls again in backward, selective
keeps attention's output and every other matmul's, recomputing the others alone. Through a run:
the same per-step losses in each mode."""

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from llmtune.config import load_config
from llmtune.model.checkpointing import ATTENTION, MATMULS, checkpoint_kwargs
from llmtune.errors import UserError

LAYERS = 2


class Counts(TorchDispatchMode):
    """How many attention kernels and matmuls run."""

    def __init__(self):
        super().__init__()
        self.attention = self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.attention += func in ATTENTION
        self.matmuls += func in MATMULS
        return func(*args, **(kwargs or {}))


def step(mode: str):
    """(loss, gradients, attention forwards, matmuls) of a forward and backward of a seeded model."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         attn_implementation="sdpa")).train()
    if mode != "none":
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs(mode))
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    counts = Counts()
    with counts:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, counts.attention, counts.matmuls


def test_each_mode_gives_the_same_loss_and_gradients_and_recomputes_what_it_says():
    loss, grads, attention, matmuls = step("none")
    assert attention == LAYERS  # the forward's; the backward runs attention's backward kernel
    recomputed = {}
    for mode in ("full", "selective"):
        found, found_grads, recomputed[mode], mode_matmuls = step(mode)
        assert found == pytest.approx(loss, rel=1e-6, abs=1e-7), mode
        for name, grad in grads.items():
            torch.testing.assert_close(found_grads[name], grad, rtol=1e-6, atol=1e-7)
        recomputed[mode] = (recomputed[mode], mode_matmuls - matmuls)
    # A layer's matmuls: q, k, v, o, gate, up, down. Full runs the layer again up to the last tensor its backward
    # needs (torch's non-reentrant checkpoint stops there): all but down's, whose output no backward reads.
    assert recomputed["full"] == (2 * LAYERS, 6 * LAYERS)
    # Selective keeps attention's output and q's, v's, gate's and down's: k, o and up run again.
    assert recomputed["selective"] == (LAYERS, 3 * LAYERS)


def test_the_modes_are_read_and_a_wrong_one_refused(tmp_path):
    def mode(value):
        recipe = {"model": {"name_or_path": "m"}, "data": {"train_files": ["d.jsonl"]},
                  "train": {"output_dir": str(tmp_path), "gradient_checkpointing": value}}
        return load_config(recipe, [], "sft", 1).train.checkpointing()

    assert [mode(v) for v in (False, True, "none", "full", "selective")] == \
        ["none", "full", "none", "full", "selective"]
    with pytest.raises(UserError, match="train.gradient_checkpointing: 'selectiv' is not valid; did you mean "
                                        "'selective'"):
        mode("selectiv")


def test_a_run_trains_the_same_steps_in_each_mode(tiny_model, sft_file, tmp_path):
    import llmtune

    losses = {}
    for mode in ("none", "full", "selective"):
        out = tmp_path / mode
        llmtune.train("sft", {"model": {"name_or_path": str(tiny_model)},
                              "data": {"train_files": [str(sft_file)], "max_seq_len": 64, "chat_template": "chatml"},
                              "train": {"output_dir": str(out), "max_steps": 3, "logging_steps": 1,
                                        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1,
                                        "learning_rate": 1e-3, "gradient_checkpointing": mode},
                              "checkpoint": {"export_hf": False}})
        losses[mode] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert f"activation checkpointing {mode}" in (out / "train.log").read_text()
    assert losses["full"] == pytest.approx(losses["none"], rel=1e-6)
    assert losses["selective"] == pytest.approx(losses["none"], rel=1e-6)


def plan_recipe(tmp_path, **train) -> str:
    """A recipe of a 2-layer Llama config alone (a plan reads no weight): peaks of 52.7 MiB without checkpointing,
    41.2 MiB with selective, 34.9 MiB with full."""
    import yaml
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024).save_pretrained(tmp_path / "model")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"config": str(tmp_path / "model"), "tokenizer": str(tmp_path / "model")},
        "data": {"train_files": ["not/needed.jsonl"], "max_seq_len": 512},
        "train": {"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 4, "global_batch_size": 16,
                  **train}}))
    return str(path)


@pytest.mark.parametrize("device_gib, chosen", [(0.08, "none"), (0.045, "selective"), (0.04, "full"),
                                                (0.01, "full")])
def test_auto_chooses_the_least_recompute_whose_plan_fits(tmp_path, capsys, device_gib, chosen):
    from llmtune.run import cli

    assert cli.main(["plan", plan_recipe(tmp_path, gradient_checkpointing="auto"), "--device-memory",
                     str(device_gib), "--task", "pt"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"train.gradient_checkpointing: auto -> {chosen}, the least recompute that fits\n")
    assert f"activations per micro-batch, checkpointing {chosen}" in out
    assert ("fit: fits" in out) == (device_gib > 0.01)  # under full too little: the plan says it does not fit


def test_auto_with_an_auto_micro_batch_takes_the_first_mode_some_micro_batch_fits_in(tmp_path, capsys):
    """At 0.04 GiB a micro-batch of 4 fits only under full checkpointing, but one of 2 fits with none: less
    recompute first, then the largest micro-batch."""
    from llmtune.run import cli

    assert cli.main(["plan", plan_recipe(tmp_path, gradient_checkpointing="auto", per_device_train_batch_size="auto"),
                     "--device-memory", "0.04", "--task", "pt"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["train.per_device_train_batch_size: auto -> 2, the largest micro-batch that fits",
                         "train.gradient_checkpointing: auto -> none, the least recompute that fits"]


def test_a_run_decides_auto_before_it_starts_and_says_so(tiny_model, sft_file, tmp_path, monkeypatch, caplog):
    """On CPU the device is the RAM available: made here just enough for selective checkpointing."""
    import logging
    from types import SimpleNamespace

    import llmtune
    from llmtune.run.plan import GIB, plan_memory

    recipe = {"model": {"name_or_path": str(tiny_model)},
              "data": {"train_files": [str(sft_file)], "max_seq_len": 64, "chat_template": "chatml"},
              "train": {"output_dir": str(tmp_path / "out"), "max_steps": 1, "per_device_train_batch_size": 4,
                        "gradient_accumulation_steps": 1, "gradient_checkpointing": "auto"},
              "checkpoint": {"export_hf": False}}
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(tiny_model)
    peaks = {mode: plan_memory(load_config({**recipe, "train": {**recipe["train"], "gradient_checkpointing": mode}},
                                           [], "sft", 1), model_config, 1).peak for mode in ("none", "selective")}
    assert peaks["selective"] < peaks["none"]
    available = (peaks["selective"] + peaks["none"]) / 2 / 0.9
    monkeypatch.setattr("llmtune.run.plan.psutil.virtual_memory", lambda: SimpleNamespace(available=available))
    with caplog.at_level(logging.INFO, logger="llmtune"):
        llmtune.train("sft", recipe)
    assert any(m.startswith("train.gradient_checkpointing: auto -> selective: the least recompute whose planned "
                            f"peak") and f"of {available / GIB:.2f} GiB, the RAM available" in m
               for m in caplog.messages)
    assert "activation checkpointing selective" in (tmp_path / "out" / "train.log").read_text()
