"""train.fp16 on one process (CPU fp16 kernels: slow, so a few steps of the tiny model): the curve follows fp32's;
steps whose scaled gradients overflow are skipped and the scale halved until they do not, loss_scale logged;
a resumed run scales and trains bitwise as the uninterrupted one. (The scale's rules alone:
tests/unit/test_loss_scale.py.)"""

import math

import pytest

import llmtune
from llmtune.errors import UserError
from llmtune.training import loss_scale
from tests.helpers import StopAt, read_metrics


def recipe(tiny_model, sft_file, output_dir, **train) -> dict:
    return {
        "model": {"name_or_path": tiny_model},
        "data": {"train_files": [sft_file], "chat_template": "basic", "max_seq_len": 64, "packing": False},
        "train": {"output_dir": output_dir, "max_steps": 6, "per_device_train_batch_size": 8, "logging_steps": 1,
                  "learning_rate": 2e-3, **train},
        "checkpoint": {"export_hf": False},
        "monitor": {"plots": False},
    }


def test_fp16_follows_fp32_and_skips_overflowing_steps_halving_the_scale(tiny_model, sft_file, tmp_path, monkeypatch):
    """From 2^24, scaled gradients overflow fp16 until the scale is small enough: those steps are skipped, counted,
    and do not stop the run (train.max_skipped_steps counts an fp16 run's skips only once the scale is below 1)."""
    llmtune.train("sft", recipe(tiny_model, sft_file, tmp_path / "fp32"))
    llmtune.train("sft", recipe(tiny_model, sft_file, tmp_path / "fp16", fp16=True))
    fp32, fp16 = read_metrics(tmp_path / "fp32"), read_metrics(tmp_path / "fp16")
    assert all(r["loss_scale"] == 2.0**16 for r in fp16), "no overflow from the default scale here"
    assert [r["loss"] for r in fp16] == pytest.approx([r["loss"] for r in fp32], rel=2e-3)

    monkeypatch.setattr(loss_scale, "INIT_SCALE", 2.0**24)
    llmtune.train("sft", recipe(tiny_model, sft_file, tmp_path / "overflow", fp16=True, max_steps=10))
    records = read_metrics(tmp_path / "overflow")
    skipped = [r["step"] for r in records if not math.isfinite(r["grad_norm"])]
    assert 0 < len(skipped) < 9 and skipped == list(range(1, len(skipped) + 1)), "the first steps overflow, then none"
    assert [r["loss_scale"] for r in records[:len(skipped) + 1]] == [2.0**(23 - i) for i in range(len(skipped))] + \
        [2.0**(24 - len(skipped))]
    assert records[-1]["skipped_steps"] == len(skipped)
    assert all(math.isfinite(r["loss"]) for r in records), "the forward never overflowed: only scaled gradients"


def test_a_resumed_fp16_run_scales_and_trains_as_the_uninterrupted_one(tiny_model, sft_file, tmp_path, monkeypatch):
    """The scale doubles every 2 good steps here, so a resume that lost it would scale differently."""
    monkeypatch.setattr(loss_scale, "GROWTH_INTERVAL", 2)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    save = {"checkpoint": {"save_steps": 3, "export_hf": False}}
    llmtune.train("sft", {**recipe(tiny_model, sft_file, straight, fp16=True), **save})
    llmtune.train("sft", {**recipe(tiny_model, sft_file, resumed, fp16=True), **save}, callbacks=[StopAt(3)])
    llmtune.train("sft", {**recipe(tiny_model, sft_file, resumed, fp16=True), **save},
                  resume_from_checkpoint="auto")
    expected, got = read_metrics(straight), read_metrics(resumed)
    assert len({r["loss_scale"] for r in expected[3:]}) > 1, "the scale still changes after the resume's step"
    assert [(r["loss"], r["loss_scale"]) for r in got] == [(r["loss"], r["loss_scale"]) for r in expected]


def test_fp16_and_bf16_together_are_refused(tiny_model, sft_file, tmp_path):
    with pytest.raises(UserError, match="train.fp16: and train.bf16 are both on"):
        llmtune.train("sft", recipe(tiny_model, sft_file, tmp_path, fp16=True, bf16=True))
