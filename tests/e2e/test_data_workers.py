"""DataLoader workers change when a micro-batch is made, never which: a run with data.num_workers 2 (as an HF user
writes it) has the per-step and validation losses of a run without, bitwise, also when it is resumed from a
checkpoint part-way through an epoch; its worker processes end with it, and on the CPU data.pin_memory (on by
default) does nothing, without a warning."""

import multiprocessing
import os
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml

from llmtune.run.cli import main as cli_main
from tests.helpers import REPO, cli_words, read_metrics

# 64 rows, 16 a step: an epoch is 4 steps; the resume from step 3 ends epoch 0 and runs all of epoch 1.
STEPS = 8


@pytest.fixture
def recipe(tmp_path, tiny_model, sft_file, assets) -> str:
    val = tmp_path / "val.jsonl"
    val.write_text("\n".join((assets / "data" / "sft_eval.jsonl").read_text().splitlines()[:10]) + "\n")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(tiny_model)},
        "data": {"train_files": [str(sft_file)], "val_files": [str(val)], "chat_template": "basic",
                 "max_seq_len": 64, "packing": False},
        "train": {"max_steps": STEPS, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 4,
                  "per_device_eval_batch_size": 4, "eval_steps": 4, "logging_steps": 1, "learning_rate": 2e-3},
        "checkpoint": {"save_steps": 3, "export_hf": False},
    }))
    return str(path)


def processes_with(marker: str) -> list[int]:
    """The processes whose environment holds marker (DataLoader's workers inherit their parent's)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:  # gone, or not ours
            continue
    return found


def curve(output_dir: Path) -> dict[int, tuple[float, float | None]]:
    return {m["step"]: (m["loss"], m.get("eval_loss")) for m in read_metrics(output_dir)}


@pytest.mark.slow
def test_workers_give_the_same_losses_resume_exactly_and_end_with_the_run(recipe, tmp_path):
    without = tmp_path / "without"
    assert cli_main(cli_words(["sft", recipe, f"train.output_dir={without}"])) == 0

    # Through bin/llmtune, which ends as every llmtune process does (process_exit: os._exit). Its output goes to a
    # file: a worker would hold a pipe open, and the wait for the pipe's end would hide a worker that outlives the
    # run. The marker finds the run's processes wherever they were re-parented.
    marker = uuid.uuid4().hex
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
           "LLMTUNE_TEST_RUN": marker}
    workers, log = tmp_path / "workers", tmp_path / "workers.log"
    with log.open("w") as stderr:
        done = subprocess.run([str(REPO / "bin" / "llmtune"), *cli_words(
            ["sft", recipe, f"train.output_dir={workers}", "--dataloader_num_workers", "2",
             "--dataloader_persistent_workers", "true"])], cwd=REPO, env=env,
            stdout=subprocess.DEVNULL, stderr=stderr, timeout=600)
    assert processes_with(f"LLMTUNE_TEST_RUN={marker}") == [], "the run's worker processes outlived it"
    assert done.returncode == 0, log.read_text()[-3000:]
    assert yaml.safe_load((workers / "config.yaml").read_text())["data"]["num_workers"] == 2
    assert "pin_memory" not in log.read_text(), "pinning on a CPU run is a no-op, not a warning"
    assert curve(workers) == curve(without)
    assert sorted(step for step, (_, eval_loss) in curve(without).items() if eval_loss is not None) == [4, 8]

    # Workers started anew at each epoch (persistent_workers off) after a resume part-way through epoch 0.
    resumed = tmp_path / "resumed"
    assert cli_main(cli_words(["sft", recipe, f"train.output_dir={resumed}", "data.num_workers=2",
                               f"checkpoint.resume_from_checkpoint={workers / 'checkpoints' / 'global_step_3'}"])) == 0
    assert curve(resumed) == {step: value for step, value in curve(workers).items() if step > 3}
    assert multiprocessing.active_children() == [], "a run in this process leaves no worker behind either"
