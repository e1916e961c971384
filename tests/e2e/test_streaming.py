"""A streaming run through the CLI, as a user starts it: data.val_files is evaluated at every
train.eval_steps and at the end."""

import math

import pytest
import yaml

from tests.helpers import read_metrics, run_cli


@pytest.mark.slow
def test_streaming_run_logs_the_validation_loss_at_the_eval_steps(tmp_path, tiny_model, sft_file, assets):
    val = tmp_path / "val.jsonl"
    val.write_text("\n".join((assets / "data" / "sft_eval.jsonl").read_text().splitlines()[:12]) + "\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(tiny_model)},
        "data": {"train_files": [str(sft_file)], "val_files": [str(val)], "chat_template": "basic",
                 "streaming": True, "max_seq_len": 64},
        "train": {"output_dir": str(tmp_path / "out"), "max_steps": 4, "eval_steps": 2, "logging_steps": 1,
                  "per_device_train_batch_size": 4},
        "checkpoint": {"export_hf": False},
    }))
    result = run_cli("sft", str(recipe))
    assert result.returncode == 0, result.stderr[-3000:]
    evaluated = {r["step"]: r["eval_loss"] for r in read_metrics(tmp_path / "out") if "eval_loss" in r}
    assert sorted(evaluated) == [2, 4]
    assert all(math.isfinite(loss) and loss > 0 for loss in evaluated.values())
