"""train.per_device_train_batch_size: auto on one process, through llmtune.train, with the device's memory set
between the plan's peaks of micro-batches 2 and 4: the run takes 2, says so in one line, records 2 in config.yaml,
and its losses are those of the run that writes 2, and (global token counting) of the run that takes the whole
global batch in one micro-batch. The choice itself: tests/unit/test_plan.py; on torchrun:
tests/dist/test_auto_micro_batch_ranks.py."""

import copy
import logging

import pytest
import yaml

import llmtune
from llmtune.config import load_config
from llmtune.model.build import load_model_config
from llmtune.run.plan import GIB, USABLE_FRACTION, plan_memory
from tests.helpers import read_metrics


def recipe(tiny_model, sft_file, output_dir, micro_batch) -> dict:
    return {
        "model": {"name_or_path": str(tiny_model)},
        "data": {"train_files": [str(sft_file)], "chat_template": "basic", "max_seq_len": 64, "packing": False},
        "train": {"output_dir": str(output_dir), "max_steps": 4, "per_device_train_batch_size": micro_batch,
                  "global_batch_size": 8, "logging_steps": 1, "learning_rate": 2e-3},
        "checkpoint": {"export_hf": False},
        "monitor": {"plots": False},
    }


def device_between_peaks(config, low: int, high: int) -> float:
    """GiB of a device whose usable part lies halfway between the plan's peaks of these two micro-batches."""
    model_config = load_model_config(config.model)
    peaks = []
    for micro_batch in (low, high):
        explicit = copy.deepcopy(config)
        explicit.use_micro_batch(micro_batch, 1)
        peaks.append(plan_memory(explicit, model_config, 1).peak)
    return sum(peaks) / 2 / GIB / USABLE_FRACTION


@pytest.mark.slow  # three runs
def test_auto_trains_the_curve_of_the_micro_batch_it_chose(tiny_model, sft_file, tmp_path, monkeypatch, caplog):
    auto = recipe(tiny_model, sft_file, tmp_path / "auto", "auto")
    device = device_between_peaks(load_config(auto, [], "sft", 1), 2, 4)
    monkeypatch.setattr("llmtune.run.micro_batch.device_memory_gib", lambda processes: device)
    with caplog.at_level(logging.INFO, logger="llmtune"):
        llmtune.train("sft", auto)
    chosen = [m for m in caplog.messages if m.startswith("train.per_device_train_batch_size: auto")]
    assert len(chosen) == 1 and chosen[0].startswith("train.per_device_train_batch_size: auto -> 2 (accumulation 4, "
                                                     "global batch 8)")
    written = yaml.safe_load((tmp_path / "auto" / "config.yaml").read_text())["train"]
    assert written["per_device_train_batch_size"] == 2 and "gradient_accumulation_steps" not in written
    losses = [r["loss"] for r in read_metrics(tmp_path / "auto")]
    for micro_batch in (2, 8):
        llmtune.train("sft", recipe(tiny_model, sft_file, tmp_path / str(micro_batch), micro_batch))
        assert [r["loss"] for r in read_metrics(tmp_path / str(micro_batch))] == pytest.approx(losses, rel=1e-5)
