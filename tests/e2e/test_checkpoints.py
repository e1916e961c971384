"""Checkpoints in one process: retention, asynchronous saves, offline export equal to the end-of-training
export (Llama with GQA, Qwen2, tied embeddings), and every kind of bad checkpoint refused clearly."""

import json
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file

from llmtune.checkpoint.manager import resolve_resume
from llmtune.checkpoint.validate import check_complete
from llmtune.config import load_config
from llmtune.errors import UserError
from llmtune.run.cli import main as cli_main
from llmtune.run.export import export_checkpoint
from llmtune.run.parallel import ParallelState
from llmtune.run.worker import build_trainer, run
from tests.helpers import read_metrics, without_plots


def recipe(root, model: str, sft_file, **checkpoint) -> str:
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"name_or_path": model},
        "data": {"train_files": [str(sft_file)], "chat_template": "basic", "max_seq_len": 64},
        "train": {"output_dir": str(root / "out"), "max_steps": 5, "per_device_train_batch_size": 2,
                  "logging_steps": 1, "learning_rate": 1e-3},
        "checkpoint": {"save_steps": 1, "export_dtype": "fp32", **checkpoint},
    }))
    return str(path)


def train(path: str, *overrides: str) -> None:
    run(load_config(path, without_plots(overrides), "sft", world_size=1))


@pytest.mark.parametrize("async_save", [False, True])
def test_retention_keeps_the_newest_complete_checkpoints(tmp_path, tiny_model, sft_file, async_save):
    train(recipe(tmp_path, str(tiny_model), sft_file, save_total_limit=2, async_save=async_save))
    root = tmp_path / "out" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["global_step_4", "global_step_5", "latest"]
    assert (root / "latest").read_text() == "global_step_5"
    for step in (4, 5):
        check_complete(root / f"global_step_{step}")
        assert json.loads((root / f"global_step_{step}" / "trainer_state.json").read_text())["step"] == step


@pytest.mark.parametrize("model", ["tiny_model", "tiny_qwen2", "tied_llama"])
def test_offline_export_equals_the_end_of_training_export(tmp_path, sft_file, model, request, capsys):
    folder = request.getfixturevalue(model)
    train(recipe(tmp_path, str(folder), sft_file, save_steps=5))
    out, checkpoint = tmp_path / "out", tmp_path / "out" / "checkpoints" / "global_step_5"
    capsys.readouterr()
    assert cli_main(["export", str(checkpoint), str(tmp_path / "offline")]) == 0
    online, offline = load_file(out / "hf" / "model.safetensors"), load_file(tmp_path / "offline" / "model.safetensors")
    assert capsys.readouterr().out == \
        f"exported {checkpoint} to {tmp_path / 'offline'} (the HF folder: {len(offline)} tensors, fp32)\n"
    assert online.keys() == offline.keys()
    assert all(torch.equal(online[k], offline[k]) and online[k].dtype == torch.float32 for k in online)
    assert ("lm_head.weight" in online) == (model != "tied_llama")
    assert (tmp_path / "offline" / "chat_template.jinja").is_file(), "the sft chat template travels with the export"
    assert cli_main(["export", str(out / "checkpoints" / "global_step_5"), str(tmp_path / "offline")]) == 2
    assert cli_main(["export", str(out / "checkpoints" / "global_step_5"), str(tmp_path / "offline"), "--overwrite",
                     "--dtype", "bf16"]) == 0
    assert load_file(tmp_path / "offline" / "model.safetensors")["model.norm.weight"].dtype == torch.bfloat16


@pytest.fixture(scope="module")
def saved(tiny_model, sft_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    train(recipe(root, str(tiny_model), sft_file, save_steps=5))
    return root / "out" / "checkpoints" / "global_step_5"


def corrupt_copy(saved, tmp_path, damage) -> str:
    target = tmp_path / "global_step_5"
    shutil.copytree(saved, target)
    damage(target)
    return target


@pytest.mark.parametrize("damage, message", [
    (lambda p: (p / ".metadata").unlink(), "incomplete checkpoint, missing .metadata"),
    (lambda p: next(p.glob("*.distcp")).unlink(), "shard __0_0.distcp is missing"),
    (lambda p: next(p.glob("*.distcp")).write_bytes(next(p.glob("*.distcp")).read_bytes()[:1000]),
     "shard __0_0.distcp is truncated"),
    (lambda p: (p / "trainer_state.json").unlink(), "incomplete checkpoint, missing trainer_state.json"),
])
def test_a_damaged_checkpoint_is_named_and_refused(saved, tmp_path, damage, message):
    target = corrupt_copy(saved, tmp_path, damage)
    with pytest.raises(UserError, match=message):
        check_complete(target)
    with pytest.raises(UserError, match=message):
        export_checkpoint(target, tmp_path / "export", "bf16", overwrite=False, merge=False)


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_manifest_lists_every_file_with_its_size_and_checksum(saved):
    files = json.loads((saved / "manifest.json").read_text())["files"]
    on_disk = {p.relative_to(saved).as_posix(): p for p in saved.rglob("*")
               if p.is_file() and p.name != "manifest.json"}
    assert files.keys() == on_disk.keys()
    assert {"extra_state/rank_0.pt", ".metadata", "__0_0.distcp", "hf_config/config.json"} <= files.keys()
    assert all(files[name]["size"] == path.stat().st_size for name, path in on_disk.items())
    check_complete(saved, checksums=True)


@pytest.mark.parametrize("damage, message", [
    (lambda p: (p / "extra_state" / "rank_0.pt").unlink(), "extra_state/rank_0.pt is missing"),
    (lambda p: (p / "hf_config" / "config.json").write_text("{}"), "hf_config/config.json has 2 bytes, not the"),
])
def test_the_manifest_catches_what_the_shard_metadata_cannot(saved, tmp_path, damage, message):
    target = corrupt_copy(saved, tmp_path, damage)
    with pytest.raises(UserError, match=f"damaged checkpoint: {message}"):
        check_complete(target)


def test_a_flipped_byte_is_caught_by_the_checksums_only(saved, tmp_path):
    target = corrupt_copy(saved, tmp_path, lambda p: flip_a_byte(p / "__0_0.distcp"))
    check_complete(target)  # sizes alone cannot see it
    with pytest.raises(UserError, match="__0_0.distcp does not match its checksum"):
        check_complete(target, checksums=True)
    assert cli_main(["export", str(target), str(tmp_path / "export"), "--verify"]) == 2
    assert not (tmp_path / "export").exists()


def test_auto_takes_the_newest_checkpoint_that_passes_and_refuses_when_none_does(saved, tmp_path, caplog):
    root = tmp_path / "checkpoints"
    for step in (3, 4, 5):
        shutil.copytree(saved, root / f"global_step_{step}")
    flip_a_byte(root / "global_step_5" / "__0_0.distcp")
    (root / "global_step_4" / ".metadata").unlink()
    assert resolve_resume("auto", tmp_path, checksums=False) == root / "global_step_5"
    assert resolve_resume("auto", tmp_path, checksums=True) == root / "global_step_3"
    assert "skipping global_step_5, which fails its check" in caplog.text
    assert "skipping global_step_4" in caplog.text
    shutil.rmtree(root / "global_step_3")
    with pytest.raises(UserError, match="every checkpoint in .* fails its check"):
        resolve_resume("latest", tmp_path, checksums=True)
    with pytest.raises(UserError, match="does not match its checksum"):
        resolve_resume(str(root / "global_step_5"), tmp_path, checksums=True)


def test_an_unfinished_save_is_never_loaded(saved, tmp_path):
    partial = tmp_path / ".global_step_7.partial"
    shutil.copytree(saved, partial)
    with pytest.raises(UserError, match="an unfinished checkpoint"):
        check_complete(partial)


def test_resume_with_another_model_says_which_shapes_differ(saved, tmp_path, tiny_qwen2, sft_file):
    path = recipe(tmp_path, str(tiny_qwen2), sft_file)
    config = load_config(path, [f"checkpoint.resume_from_checkpoint={saved}"], "sft", world_size=1)
    state = ParallelState.initialize()
    try:
        with pytest.raises(UserError, match=r"the recipe's model differs from the checkpoint's: .*q_proj.bias"):
            build_trainer(config, state)
    finally:
        state.close()


def test_resume_latest_without_checkpoint_starts_fresh(tmp_path, tiny_model, sft_file, caplog):
    train(recipe(tmp_path, str(tiny_model), sft_file, save_steps=0), "checkpoint.resume_from_checkpoint=latest",
          "train.max_steps=2", "monitor.plots=true")
    assert "has no checkpoint yet; starting fresh" in caplog.text
    assert (tmp_path / "out" / "hf").is_dir()
    assert len(list((tmp_path / "out" / "plots").glob("*.png"))) == 5, "the run's end draws its curves"


def test_save_epochs_saves_at_each_epoch_end_and_at_the_end(tmp_path, tiny_model, sft_file):
    path = recipe(tmp_path, str(tiny_model), sft_file, save_steps=0, save_epochs=1)
    train(path, "data.packing=false", "train.per_device_train_batch_size=16", "train.max_steps=5")
    names = sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir())
    assert names == ["global_step_4", "global_step_5", "latest"], "64 samples = 4 steps an epoch, then the end"
    assert not (tmp_path / "out" / "plots").exists(), "monitor.plots=false draws none"


def test_a_resumed_runs_first_record_averages_the_steps_the_straight_runs_does(tmp_path, tiny_model, sft_file):
    """Records every 3 steps, a checkpoint at step 2: the steps since the last record travel in the checkpoint, so
    the resumed run's record at step 3 is the mean of steps 1 to 3, bitwise the straight run's."""
    path = recipe(tmp_path, str(tiny_model), sft_file, save_steps=2)
    straight, resumed = tmp_path / "out", tmp_path / "resumed"
    train(path, "train.logging_steps=3")
    train(path, "train.logging_steps=3", f"train.output_dir={resumed}",
          f"checkpoint.resume_from_checkpoint={straight / 'checkpoints' / 'global_step_2'}")
    losses = [[(r["step"], r["loss"]) for r in read_metrics(out) if "loss" in r] for out in (straight, resumed)]
    assert losses[0] == losses[1] and [step for step, _ in losses[0]] == [3, 5]
