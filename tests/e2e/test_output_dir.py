"""One output_dir, one run: a new run refuses a folder holding another run's checkpoints or export (or starts over
with train.overwrite_output_dir), auto never resumes from a checkpoint newer than the `latest` pointer, the summary
names this run's checkpoint, and a folder that cannot be written is refused before any work."""

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from llmtune.checkpoint.manager import resolve_resume
from llmtune.run.cli import main as cli_main
from tests.helpers import REPO


def recipe(root, model, sft_file, **train) -> str:
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(model)},
        "data": {"train_files": [str(sft_file)], "chat_template": "basic", "max_seq_len": 64},
        "train": {"output_dir": str(root / "out"), "per_device_train_batch_size": 2, "logging_steps": 5,
                  "learning_rate": 1e-3, **train},
        "checkpoint": {"export_dtype": "fp32"},
        "monitor": {"plots": False},  # no test here reads them
    }))
    return str(path)


def steps_in(out) -> list[str]:
    return sorted((p.name for p in (out / "checkpoints").iterdir()), key=lambda n: (len(n), n))


def test_a_fresh_run_refuses_an_earlier_runs_folder_and_starts_over_only_when_told(
        tmp_path, tiny_model, sft_file, capsys, caplog):
    path, out = recipe(tmp_path, tiny_model, sft_file, max_steps=12), tmp_path / "out"
    assert cli_main(["sft", path, "--save_steps", "4"]) == 0
    assert steps_in(out) == ["latest", "global_step_4", "global_step_8", "global_step_12"]
    exported = (out / "hf" / "model.safetensors").read_bytes()
    first_log = (out / "train.log").read_text()
    assert "run finished at step 12 of 12" in first_log
    capsys.readouterr()

    # The reproduction of the issue: a fresh 4-step run saving every 2 steps into the same folder.
    assert cli_main(["sft", path, "--max_steps", "4", "--save_steps", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert str(out) in err and "checkpoint.resume_from_checkpoint: auto" in err
    assert "train.overwrite_output_dir: true" in err
    assert steps_in(out) == ["latest", "global_step_4", "global_step_8", "global_step_12"], "nothing was touched"
    assert (out / "hf" / "model.safetensors").read_bytes() == exported
    assert (out / "train.log").read_text() == first_log

    # Starting over removes the earlier run's checkpoints and export before this run writes.
    caplog.set_level(logging.INFO, logger="llmtune")
    assert cli_main(["sft", path, "--max_steps", "4", "--save_steps", "2", "--overwrite_output_dir", "true",
                     "--export_hf", "false"]) == 0
    assert steps_in(out) == ["latest", "global_step_2", "global_step_4"]
    assert not (out / "hf").exists(), "the earlier run's export is gone: it is not this run's model"
    summary = caplog.records[-1].getMessage()
    assert "at step 4 of 4" in summary and f"newest checkpoint {out / 'checkpoints' / 'global_step_4'}" in summary
    assert "at step 12 of 12" not in (out / "train.log").read_text(), "a new run starts its train.log afresh"

    # auto goes on from this run's newest checkpoint.
    caplog.clear()
    assert cli_main(["sft", path, "--max_steps", "6", "--save_steps", "2", "--resume_from_checkpoint", "auto"]) == 0
    assert any(f"resumed from {out / 'checkpoints' / 'global_step_4'} at step 4" in r.getMessage()
               for r in caplog.records)
    # The run that goes on adds to the log of the run it continues: the whole story in one file.
    story = (out / "train.log").read_text()
    assert story.index("run finished at step 4 of 4") < story.index("optimizer steps, resuming after step 4") \
        < story.index("run finished at step 6 of 6")


def test_a_run_refused_once_it_is_built_leaves_nothing_but_the_reason_in_a_resumed_runs_train_log(
        tmp_path, tiny_model, sft_file, capsys):
    """The data's refusal is found by the worker, after rank 0 started the output folder (train.log): a refused run
    writes nothing, so what it added goes, and what was there stays (the run it would have gone on from tells it)."""
    path, out = recipe(tmp_path, tiny_model, sft_file, max_steps=2, per_device_train_batch_size=1000), tmp_path / "out"
    assert cli_main(["sft", path]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1].removeprefix("llmtune: error: ")
    assert error.startswith("data: ") and "do not fill one optimizer step" in error
    assert not out.exists(), "the folder the refused run made is gone"

    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    assert cli_main(["sft", path]) == 2
    assert [p.name for p in out.iterdir()] == ["notes.txt"], "a folder that was there keeps what it held, alone"

    assert cli_main(["sft", path, "--per_device_train_batch_size", "2", "--save_steps", "2", "--export_hf",
                     "false"]) == 0
    held, resolved, story = sorted(p.name for p in out.iterdir()), (out / "config.yaml").read_text(), \
        (out / "train.log").read_text()
    assert cli_main(["sft", path, "--max_steps", "4", "--resume_from_checkpoint", "auto"]) == 2
    logged = (out / "train.log").read_text()
    assert logged.startswith(story), "the resumed run's train.log is kept"
    assert logged.splitlines()[-1].endswith(f" ERROR llmtune: the run ended with UserError: {error}")
    assert sorted(p.name for p in out.iterdir()) == held
    assert (out / "config.yaml").read_text() == resolved, "config.yaml stays the resumed run's"


def test_auto_never_resumes_past_the_latest_pointer(tmp_path, tiny_model, sft_file, caplog):
    """A checkpoint newer than `latest` was left by another run (one that started over in the folder, or went back
    to an older checkpoint): neither auto nor the summary may take it as this run's."""
    path, out = recipe(tmp_path, tiny_model, sft_file, max_steps=4), tmp_path / "out"
    assert cli_main(["sft", path, "--save_steps", "2"]) == 0
    shutil.copytree(out / "checkpoints" / "global_step_4", out / "checkpoints" / "global_step_12")
    assert resolve_resume("auto", out, checksums=False) == out / "checkpoints" / "global_step_4"
    assert resolve_resume("latest", out, checksums=False) == out / "checkpoints" / "global_step_4"
    caplog.set_level(logging.INFO, logger="llmtune")
    assert cli_main(["sft", path, "--max_steps", "5", "--save_steps", "5", "--resume_from_checkpoint", "auto",
                     "--export_hf", "false"]) == 0
    assert any("resumed from" in r.getMessage() and "global_step_4 at step 4" in r.getMessage()
               for r in caplog.records)
    summary = caplog.records[-1].getMessage()
    assert "global_step_5" in summary and "global_step_12" not in summary


def test_starting_over_and_going_on_at_once_is_refused(tmp_path, tiny_model, sft_file, capsys):
    path = recipe(tmp_path, tiny_model, sft_file, max_steps=2)
    assert cli_main(["sft", path, "--overwrite_output_dir", "true", "--resume_from_checkpoint", "auto"]) == 2
    err = capsys.readouterr().err
    assert "train.overwrite_output_dir" in err and "keep one of the two" in err
    assert not (tmp_path / "out").exists()


def test_an_export_without_checkpoints_is_not_started_over_by_auto(tmp_path, tiny_model, sft_file, capsys):
    path, out = recipe(tmp_path, tiny_model, sft_file, max_steps=2), tmp_path / "out"
    assert cli_main(["sft", path]) == 0
    exported = (out / "hf" / "model.safetensors").read_bytes()
    capsys.readouterr()
    # Run again as it was: auto, which would be refused in turn, is not offered.
    assert cli_main(["sft", path]) == 2
    err = capsys.readouterr().err
    assert "an export (hf/)" in err and "train.overwrite_output_dir: true" in err and "another train.output_dir" in err
    assert "resume_from_checkpoint" not in err, "no checkpoint to go on from"
    assert cli_main(["sft", path, "--resume_from_checkpoint", "auto"]) == 2
    err = capsys.readouterr().err
    assert "an export (hf/)" in err and "train.overwrite_output_dir: true" in err
    assert "resume_from_checkpoint: auto to go on" not in err, "auto has nothing to go on from"
    assert (out / "hf" / "model.safetensors").read_bytes() == exported


def test_an_output_dir_below_a_file_is_refused_in_one_line(tmp_path, tiny_model, sft_file, capsys):
    (tmp_path / "taken").write_text("a file")
    path = recipe(tmp_path, tiny_model, sft_file, max_steps=2, output_dir=str(tmp_path / "taken" / "out"))
    assert cli_main(["sft", path]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"llmtune: error: train.output_dir: {tmp_path / 'taken' / 'out'} cannot be created: " \
                  f"{tmp_path / 'taken'} is a file; choose another folder"


def test_an_output_dir_without_write_permission_is_refused_before_any_work(tiny_model, sft_file):
    # Root may write anywhere: the check is run as an unprivileged user, as most users run it, in a folder of its own
    # that that user can read (pytest's are private to root).
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        root.chmod(0o755)
        locked = root / "locked"
        locked.mkdir(mode=0o555)
        shutil.copytree(tiny_model, root / "model")
        shutil.copy(sft_file, root / "train.jsonl")
        path = recipe(root, root / "model", root / "train.jsonl", max_steps=2, output_dir=str(locked / "out"))
        unprivileged = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
        if subprocess.run([*unprivileged, sys.executable, "-c", "pass"], capture_output=True).returncode:
            pytest.skip(f"{sys.executable} cannot run as an unprivileged user here (its files are private to root)")
        result = subprocess.run([*unprivileged, sys.executable, "-c", "import sys; from llmtune.run.cli import main; "
                                 f"sys.exit(main(['sft', {path!r}]))"], cwd=REPO, capture_output=True, text=True,
                                env={**os.environ, "HOME": tmp}, timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == f"llmtune: error: train.output_dir: {locked / 'out'} cannot be created: no " \
                                    f"permission to write in {locked}; choose a folder you can write, or change its " \
                                    "permissions"
