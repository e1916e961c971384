"""data.test_files on one process, through llmtune.train: evaluated once when training ends, with the final weights,
into metrics.jsonl's last record (its own, at the last step), the callbacks' on_evaluate after on_train_end (as the HF
Trainer's evaluate(test_dataset) after train()), RunResult.test_loss and the summary; its loss is the one the
validation code gives the same file at the last step. A test file that does not exist is refused before training."""

import logging

import pytest

import llmtune
from llmtune.errors import UserError
from llmtune.training.callbacks import Callback
from tests.helpers import read_metrics


def recipe(tiny_model, sft_file, output_dir, val_file, test_file) -> dict:
    return {
        "model": {"name_or_path": str(tiny_model)},
        "data": {"train_files": [str(sft_file)], "val_files": [str(val_file)], "test_files": [str(test_file)],
                 "chat_template": "basic", "max_seq_len": 64},
        "train": {"output_dir": str(output_dir), "max_steps": 4, "per_device_train_batch_size": 4,
                  "logging_steps": 2, "learning_rate": 2e-3, "per_device_eval_batch_size": 8},
        "checkpoint": {"export_hf": False},
        "monitor": {"plots": False},
    }


class Events(Callback):
    def __init__(self):
        self.events = []

    def on_train_end(self, args, state, control, **kwargs):
        self.events.append(("on_train_end", state.step, None))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.events.append(("on_evaluate", state.step, dict(metrics)))


def test_the_test_split_is_evaluated_once_at_the_end(tiny_model, sft_file, assets, tmp_path, caplog):
    test_file = assets / "data" / "sft_eval.jsonl"
    events = Events()
    with caplog.at_level(logging.INFO, logger="llmtune"):
        result = llmtune.train("sft", recipe(tiny_model, sft_file, tmp_path, test_file, test_file), callbacks=[events])
    records = read_metrics(tmp_path)
    last = records[-1]
    assert set(last) == {"step", "epoch", "test_loss"} and last["step"] == 4, "a record of its own at the last step"
    assert [r for r in records if "test_loss" in r] == [last], "evaluated once"
    # The same file as validation: the final weights' eval_loss at the last step, by the same evaluation code.
    assert records[-2]["step"] == 4 and last["test_loss"] == pytest.approx(records[-2]["eval_loss"], rel=1e-6)
    assert result.test_loss == last["test_loss"]
    assert events.events[-2:] == [("on_train_end", 4, None), ("on_evaluate", 4, {"test_loss": last["test_loss"]})]
    summary = next(m for m in caplog.messages if m.startswith("run finished"))
    assert f"test loss {last['test_loss']:.4f}" in summary


def test_a_missing_test_file_is_refused_before_training(tiny_model, sft_file, tmp_path):
    with pytest.raises(UserError, match="data.test_files: '.*missing.jsonl' matches no data file"):
        llmtune.train("sft", recipe(tiny_model, sft_file, tmp_path / "out", sft_file, tmp_path / "missing.jsonl"))
    assert not (tmp_path / "out").exists()
