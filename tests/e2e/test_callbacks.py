"""Callbacks on one process, through llmtune.train with instances: the HF Trainer's events in its order with what
each carries; the control (a record, a stop) acted on; on_log's edit reaching metrics.jsonl; callbacks written for
the HF Trainer (transformers' TrainerCallback, its TensorBoardCallback) reading TrainingArguments' names and
log_history; a callback's state and the log history in every checkpoint and back on resume (on_load); the built-in
early stopping; a callback that raises stops the run with its name, the last checkpoint kept. (Ranks agreeing:
tests/dist/test_callback_ranks.py.)"""

import json
import os

import pytest
from transformers import TrainerCallback
from transformers.integrations import TensorBoardCallback

import llmtune
from llmtune.errors import TrainingStopped
from llmtune.training.callbacks import EVENTS, Callback
from tests.helpers import read_metrics


def recipe(tiny_model, sft_file, output_dir, **train) -> dict:
    return {
        "model": {"name_or_path": tiny_model},
        "data": {"train_files": [sft_file], "val_files": [sft_file], "chat_template": "basic", "max_seq_len": 64,
                 "packing": False},
        "train": {"output_dir": output_dir, "max_steps": 4, "per_device_train_batch_size": 2,
                  "gradient_accumulation_steps": 2, "logging_steps": 3, "learning_rate": 2e-3,
                  "per_device_eval_batch_size": 16, **train},
        "checkpoint": {"save_steps": 2, "export_dtype": "fp32"},
        "monitor": {"plots": False},
    }


class Recorder(Callback):
    """Every event with the step it saw; what the events carry; asks for a record at step 1, which is not due."""

    def __init__(self):
        self.events, self.grad_norms, self.evaluations, self.saved, self.kwargs = [], {}, {}, [], set()

    def on_pre_optimizer_step(self, args, state, control, grad_norm=None, **kwargs):
        self.events.append(("on_pre_optimizer_step", state.step))
        self.grad_norms[state.step + 1] = grad_norm

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(("on_step_end", state.step))
        self.kwargs.update(kwargs.keys())
        self.args_output_dir = args.train.output_dir
        control.should_log = state.step == 1

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.events.append(("on_evaluate", state.step))
        self.evaluations[state.step] = dict(metrics)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append(("on_log", state.step))
        logs["seen_by_callback"] = state.step

    def on_save(self, args, state, control, checkpoint=None, **kwargs):
        self.events.append(("on_save", state.step))
        self.saved.append(checkpoint)


class WritesItsLog(TrainerCallback):
    """Written for the HF Trainer: a line under args.output_dir at each on_log, from TrainingArguments' names and the
    TrainerState's log_history."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero:
            with open(os.path.join(args.output_dir, "hf_callback.jsonl"), "a") as f:
                f.write(json.dumps({"step": state.global_step, "history": state.log_history, "args": [
                    args.learning_rate, args.max_steps, args.per_device_train_batch_size,
                    args.gradient_accumulation_steps, args.logging_steps, args.eval_steps, args.save_steps,
                    args.report_to, args.lr_scheduler_type, args.eval_strategy, args.seed]}) + "\n")


for _name in set(EVENTS) - set(vars(Recorder)):
    setattr(Recorder, _name, lambda self, args, state, control, _name=_name, **kwargs:
            self.events.append((_name, state.step)))


def test_events_come_in_the_hf_trainers_order_with_what_they_carry(tiny_model, sft_file, tmp_path):
    recorder = Recorder()
    out = tmp_path / "run"
    llmtune.train("sft", recipe(tiny_model, sft_file, out), callbacks=[recorder, WritesItsLog(), TensorBoardCallback()],
                  eval_steps=2)
    micro_steps = lambda k: [("on_step_begin", k - 1), ("on_substep_end", k - 1), ("on_pre_optimizer_step", k - 1),
                             ("on_optimizer_step", k - 1), ("on_step_end", k)]
    expected = [("on_init_end", 0), ("on_train_begin", 0), ("on_epoch_begin", 0),
                *micro_steps(1), ("on_log", 1),
                *micro_steps(2), ("on_evaluate", 2), ("on_log", 2), ("on_save", 2),
                *micro_steps(3), ("on_log", 3),
                *micro_steps(4), ("on_evaluate", 4), ("on_log", 4), ("on_save", 4),
                ("on_epoch_end", 4), ("on_train_end", 4)]
    assert recorder.events == expected
    records = {r["step"]: r for r in read_metrics(out)}
    assert sorted(records) == [1, 2, 3, 4], "step 1 logged because a callback asked (logging_steps is 3)"
    assert all(r["seen_by_callback"] == step for step, r in records.items()), "on_log's edit reached metrics.jsonl"
    assert {step: r["grad_norm"] for step, r in records.items()} == {s: recorder.grad_norms[s] for s in records}
    assert recorder.evaluations == {step: {"eval_loss": records[step]["eval_loss"]} for step in (2, 4)}
    assert recorder.saved == [out / "checkpoints" / f"global_step_{step}" for step in (2, 4)]
    assert {"model", "optimizer", "lr_scheduler"} <= recorder.kwargs
    assert recorder.args_output_dir == str(out)

    lines = [json.loads(line) for line in (out / "hf_callback.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    assert lines[0]["args"] == [2e-3, 4, 2, 2, 3, 2, 2, [], "cosine_with_min_lr", "steps", 42]
    history = lines[-1]["history"]
    assert all(line["history"] == history[:len(line["history"])] for line in lines), "the history grows by records"
    assert [(entry["step"], "loss" in entry, "eval_loss" in entry) for entry in history] == [
        (1, True, False), (2, True, False), (2, False, True), (3, True, False), (4, True, False), (4, False, True)], \
        "an evaluation is an entry of its own, as the HF Trainer logs it"
    training = [entry for entry in history if "loss" in entry]
    assert [(e["loss"], e["learning_rate"], e["grad_norm"], e["epoch"]) for e in training] == \
        [(r["loss"], r["lr"], r["grad_norm"], r["epoch"]) for r in records.values()]
    assert [e["eval_loss"] for e in history if "eval_loss" in e] == [records[2]["eval_loss"], records[4]["eval_loss"]]
    assert not any("lr" in entry or "seen_by_callback" in entry for entry in history), \
        "HF's names; added to the history before on_log's edits, as HF adds it"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(next((out / "runs").iterdir())), size_guidance={"scalars": 0})
    board.Reload()
    assert [(e.step, round(e.value, 5)) for e in board.Scalars("train/loss")] == \
        [(step, round(r["loss"], 5)) for step, r in records.items()], "transformers' TensorBoardCallback ran as written"


class Counter(Callback):
    """Counts the steps it has seen (its state); stops training at stop_at; remembers what on_load got."""

    def __init__(self, stop_at=None):
        self.count, self.stop_at, self.loaded = 0, stop_at, None

    def on_step_end(self, args, state, control, **kwargs):
        self.count += 1
        control.should_training_stop = state.step == self.stop_at

    def on_load(self, args, state, control, checkpoint=None, **kwargs):
        self.loaded = (checkpoint, state.step, self.count)
        self.history = list(state.log_history)

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def test_a_stop_asked_by_a_callback_saves_and_exports_and_its_state_resumes(tiny_model, sft_file, tmp_path):
    out = tmp_path / "run"
    result = llmtune.train("sft", recipe(tiny_model, sft_file, out, max_steps=8, logging_steps=1),
                           callbacks=[Counter(stop_at=3)])
    assert (result.steps, result.total_steps) == (3, 8)
    assert result.checkpoint == out / "checkpoints" / "global_step_3", "the stop saved the step it ended at"
    assert result.export == out / "hf"
    state = json.loads((out / "checkpoints" / "global_step_3" / "trainer_state.json").read_text())
    assert state["callbacks"] == [{"name": "Counter", "state": {"count": 3}}]

    resumed = Counter()
    checkpoint = out / "checkpoints" / "global_step_2"
    llmtune.train("sft", recipe(tiny_model, sft_file, tmp_path / "resumed", max_steps=4), callbacks=[resumed],
                  resume_from_checkpoint=str(checkpoint))
    assert resumed.loaded == (checkpoint, 2, 2), "on_load after the state came back"
    assert resumed.count == 4
    assert [(entry["step"], entry["loss"]) for entry in resumed.history] == \
        [(r["step"], r["loss"]) for r in read_metrics(out)[:2]], "the log history of the steps before the checkpoint"


def test_early_stopping_stops_after_patience_evaluations_without_improvement(tiny_model, sft_file, tmp_path):
    """A threshold no evaluation can beat: the first sets the best, the next two do not improve on it."""
    out = tmp_path / "run"
    result = llmtune.train("sft", recipe(tiny_model, sft_file, out, max_steps=8, eval_steps=1,
                                         early_stopping_patience=2, early_stopping_threshold=100.0))
    assert result.steps == 3
    assert [r["step"] for r in read_metrics(out) if "eval_loss" in r] == [1, 2, 3]


class Boom(Callback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.step == 3:
            raise ValueError("no more steps for you")


def test_a_callback_that_raises_stops_the_run_naming_it_and_keeps_the_last_checkpoint(tiny_model, sft_file, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(TrainingStopped, match="callback Boom raised in on_step_end: ValueError: no more steps for you"):
        llmtune.train("sft", recipe(tiny_model, sft_file, out), callbacks=[Boom()])
    assert (out / "checkpoints" / "latest").read_text() == "global_step_2"
    assert not (out / "checkpoints" / "global_step_3").exists() and not (out / "hf").exists()


def test_save_best_outlives_retention_resumes_and_is_what_export_from_best_exports(tiny_model, sft_file, tmp_path):
    """greater_is_better on eval_loss makes the first save the best (the loss falls), so best, last and the ones
    between all differ; eval_steps 0: save_best evaluates before each save itself."""
    from safetensors.torch import load_file

    from llmtune.run.cli import main as cli_main

    out = tmp_path / "run"
    checkpoint = {"save_steps": 2, "save_best": True, "greater_is_better": True, "save_total_limit": 1,
                  "export_from": "best", "export_dtype": "fp32"}
    llmtune.train("sft", recipe(tiny_model, sft_file, out, max_steps=6, logging_steps=1), checkpoint=checkpoint)
    records = read_metrics(out)
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert sorted(evals) == [2, 4, 6] and evals[2] > evals[4] > evals[6]
    best = out / "checkpoints" / "best"
    state = json.loads((best / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["best"] == {"metric": "eval_loss", "value": evals[2], "step": 2}
    assert state["eval_metrics"] == {"step": 2, "eval_loss": evals[2]}, "each checkpoint records its eval metrics"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["best", "global_step_6", "latest"]

    assert cli_main(["export", str(best), str(tmp_path / "best_hf")]) == 0
    assert cli_main(["export", str(out / "checkpoints" / "global_step_6"), str(tmp_path / "last_hf")]) == 0
    exported, of_best, of_last = (load_file(folder / "model.safetensors")
                                  for folder in (out / "hf", tmp_path / "best_hf", tmp_path / "last_hf"))
    assert all(exported[name].equal(of_best[name]) for name in of_best)
    assert not all(exported[name].equal(of_last[name]) for name in of_last)

    llmtune.train("sft", recipe(tiny_model, sft_file, out, max_steps=3, logging_steps=1),
                  checkpoint={"save_steps": 0, "resume_from_checkpoint": "best", "export_hf": False})
    resumed = read_metrics(out)
    assert [r["step"] for r in resumed] == [1, 2, 3], "went on from step 2"
    assert resumed[2]["loss"] == records[2]["loss"], "step 3 again, from best's exact state"


def test_evaluation_before_the_first_step_at_epoch_ends_and_before_every_save(tiny_model, sft_file, tmp_path):
    """64 rows, 8 per step: epochs of 8 steps."""
    out = tmp_path / "run"
    llmtune.train("sft", recipe(tiny_model, sft_file, out, max_steps=-1, num_train_epochs=2,
                                per_device_train_batch_size=4, eval_on_start=True, eval_epochs=1),
                  checkpoint={"save_steps": 5, "eval_on_save": True})
    records = read_metrics(out)
    assert [r["step"] for r in records if "eval_loss" in r] == [0, 5, 8, 10, 15, 16]
    assert set(records[0]) == {"step", "epoch", "eval_loss"}, "the start's evaluation is a record of its own"
    state = json.loads((out / "checkpoints" / "global_step_5" / "trainer_state.json").read_text())
    assert state["eval_metrics"]["step"] == 5
