"""Moving averages across layouts: the averages of a 2-process run equal those of the same run on 1 process, and a
1-process run resumed from the 2-process run's checkpoint (the averages resharded by DCP) ends with the same
averages, both within 1e-6 relative."""

import torch
import yaml
from safetensors.torch import load_file

import llmtune
from tests.helpers import run_cli


def overrides(output_dir) -> dict:
    return {"train.output_dir": str(output_dir), "train.max_steps": 4, "train.per_device_train_batch_size": 4,
            "train.global_batch_size": 8, "train.learning_rate": 5e-3, "train.ema_decay": 0.8,
            "checkpoint.save_steps": 2, "checkpoint.export_ema": True, "checkpoint.export_dtype": "fp32",
            "monitor.plots": False}


def test_averages_are_the_same_on_2_processes_on_1_and_resumed_from_2_on_1(tiny_model, sft_file, tmp_path):
    recipe = {"model": {"name_or_path": str(tiny_model)},
              "data": {"train_files": [str(sft_file)], "chat_template": "basic", "max_seq_len": 64, "packing": False}}
    two = tmp_path / "two"
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    result = run_cli("sft", str(tmp_path / "recipe.yaml"), *[f"{k}={v}" for k, v in overrides(two).items()],
                     "--nproc", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    llmtune.train("sft", recipe, **overrides(tmp_path / "one"))
    llmtune.train("sft", recipe, **overrides(tmp_path / "resumed"),
                  **{"checkpoint.resume_from_checkpoint": str(two / "checkpoints" / "global_step_2")})
    expected = load_file(two / "hf_ema" / "model.safetensors")
    for run in ("one", "resumed"):
        got = load_file(tmp_path / run / "hf_ema" / "model.safetensors")
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=f"{run}: {name}")
