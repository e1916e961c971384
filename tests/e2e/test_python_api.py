"""llmtune.train, the Python entry point: the CLI's run in the calling process, from a recipe dict or path with
keyword overrides, returning the run's result; bad input raises the CLI's exception with the CLI's message."""

import copy
import os
import signal

import pytest
import yaml

import llmtune
from llmtune.config import plain
from llmtune.errors import Preempted, UserError
from tests.helpers import read_metrics, run_cli


def recipe(tiny_model, sft_file, output_dir) -> dict:
    """Paths as Python gives them (pathlib), where a YAML recipe has strings."""
    return {
        "model": {"name_or_path": tiny_model},
        "data": {"train_files": [sft_file], "val_files": (sft_file,), "chat_template": "basic", "max_seq_len": 64},
        "train": {"output_dir": output_dir, "max_steps": 8, "per_device_train_batch_size": 4,
                  "logging_steps": 1, "learning_rate": 2e-3},
        "checkpoint": {"save_steps": 4},
        "monitor": {"plots": False},  # no test here reads them
    }


@pytest.fixture(scope="module")
def api_run(tiny_model, sft_file, tmp_path_factory):
    """One run through llmtune.train: the dict, what it returned, and the output folder."""
    out = tmp_path_factory.mktemp("api")
    given = recipe(tiny_model, sft_file, out / "run")
    kept = copy.deepcopy(given)
    # The three ways to write an override: a key one section has, section.key, a section's dict.
    result = llmtune.train("sft", given, max_steps=6, **{"train.eval_steps": 2}, checkpoint={"save_steps": 3})
    assert given == kept, "the caller's dict is left as it was"
    return given, result, out / "run"


def test_the_result_is_the_runs_records(api_run):
    _, result, out = api_run
    records = read_metrics(out)
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert (result.steps, result.total_steps) == (6, 6), "max_steps=6 replaced the dict's 8"
    assert len(evals) == 3, "train.eval_steps=2 was applied"
    assert result.output_dir == out
    assert result.tokens == sum(r["input_tokens"] for r in records) > 0
    assert result.loss == records[-1]["loss"]
    assert (result.eval_loss, result.best_eval_loss) == (evals[-1], min(evals))
    assert (result.metrics, result.eval_metrics) == ({}, {"eval_loss": evals[-1]}), "sft has no metrics of its own"
    assert result.checkpoint == out / "checkpoints" / "global_step_6", "checkpoint.save_steps=3 saved at 3 and 6"
    assert (out / "checkpoints" / "global_step_3").is_dir()
    assert result.export == out / "hf" and (out / "hf" / "config.json").is_file()
    assert result.adapter is None


@pytest.mark.slow
def test_the_cli_trains_the_same_run(api_run, tmp_path):
    """The same recipe and overrides through bin/llmtune: the same losses step by step."""
    given, _, out = api_run
    cli_recipe = plain(given)
    cli_recipe["train"]["output_dir"] = str(tmp_path / "cli")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(cli_recipe))
    done = run_cli("sft", str(path), "--max_steps", "6", "train.eval_steps=2", "checkpoint.save_steps=3")
    assert done.returncode == 0, done.stderr
    api, cli = read_metrics(out), read_metrics(tmp_path / "cli")
    for key in ("loss", "eval_loss"):
        api_values = [(r["step"], r[key]) for r in api if key in r]
        cli_values = [(r["step"], r[key]) for r in cli if key in r]
        assert [step for step, _ in api_values] == [step for step, _ in cli_values] and api_values
        assert [value for _, value in api_values] == pytest.approx([value for _, value in cli_values], rel=1e-5)


def test_a_recipe_path_resumes_from_the_newest_checkpoint(api_run, tmp_path):
    """A recipe given by path; resume_from_checkpoint="auto" continues the run the first call left at step 6."""
    given, _, out = api_run
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(plain(given)))
    result = llmtune.train("sft", path, resume_from_checkpoint="auto", max_steps=8, eval_steps=2,
                           checkpoint={"save_steps": 3})
    assert (result.steps, result.checkpoint) == (8, out / "checkpoints" / "global_step_8")
    assert [r["step"] for r in read_metrics(out)][-2:] == [7, 8]


@pytest.mark.parametrize("section, value", [("train", {"learning_rate": "fast"}), ("data", {"max_seq_len": -1})])
def test_bad_input_raises_the_clis_error_with_its_message(tiny_model, sft_file, tmp_path, section, value):
    bad = recipe(tiny_model, sft_file, tmp_path / "run")
    bad[section].update(value)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(plain(bad)))
    done = run_cli("sft", str(path))
    assert done.returncode == UserError.exit_code
    with pytest.raises(UserError) as raised:
        llmtune.train("sft", path)
    assert done.stderr.strip() == f"llmtune: error: {raised.value}"
    with pytest.raises(UserError) as from_dict:
        llmtune.train("sft", bad)
    assert str(from_dict.value) == str(raised.value).replace(str(path), "recipe")
    assert not (tmp_path / "run").exists(), "refused before anything is written"


@pytest.mark.parametrize("task, overrides, message", [
    ("ppo", {}, "task: 'ppo' is not a task; use pt, sft, dpo, kto, grpo or rm"),
    ("sft", {"nproc": 2}, "nproc: llmtune.train runs in this process"),
    ("sft", {"learnin_rate": 1e-4}, "--learnin_rate: no recipe key has this name; did you mean --learning_rate"),
])
def test_bad_arguments_are_named(tiny_model, sft_file, tmp_path, task, overrides, message):
    with pytest.raises(UserError) as raised:
        llmtune.train(task, recipe(tiny_model, sft_file, tmp_path / "run"), **overrides)
    assert str(raised.value).startswith(message)


class SignalsItself:
    """SIGUSR1 to this process after optimizer step 1, as a scheduler's warning before a time limit."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.step == 1:
            os.kill(os.getpid(), signal.SIGUSR1)


def test_a_run_stopped_by_a_signal_raises_preempted_and_gives_the_caller_its_handlers_back(tiny_model, sft_file,
                                                                                          tmp_path):
    """The stopped run keeps noting signals while it ends (training/stop_signals.py); a process that goes on after
    llmtune.train has its own handlers again."""
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(Preempted, match=r"stopped by SIGUSR1 after step 1 of 8; saved .*; resume with: the same "):
        llmtune.train("sft", recipe(tiny_model, sft_file, tmp_path / "run"), callbacks=[SignalsItself()])
    assert signal.getsignal(signal.SIGUSR1) is before
