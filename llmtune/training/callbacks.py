"""Callbacks: user code at the HF Trainer's named points of the loop, and the control through which it steers the run.

A callback is any object with some of the EVENTS as methods (subclassing Callback is optional), called on every
rank as the HF Trainer calls its TrainerCallback: `on_step_end(args, state, control, **kwargs)`, args the run's
Config, state a CallbackState (rank, world size, step, epoch, ...), control the TrainerControl, and in kwargs the
model, optimizer and lr_scheduler plus what the event carries (on_pre_optimizer_step: grad_norm, on_evaluate:
metrics, on_log: logs (edit it to change the record), on_save and on_load: checkpoint). A callback may set the
control's flags, or return a TrainerControl as HF's do.

A flag set on one rank acts on all: the trainer agrees on them (one all-reduce of every rank's flags) before it
acts, so one rank's early stop stops every rank at the same step. A callback that raises stops the run on every
rank at that agreement, with its name and message (TrainingStopped, exit 1); nothing is saved then, the last
checkpoint stays the one to resume from. A callback's state_dict() (plain data) is kept in every checkpoint's
trainer_state.json and given back to load_state_dict() on resume.
"""

import importlib
import operator
from dataclasses import dataclass, fields

from llmtune.checkpoint.best import better
from llmtune.errors import TrainingStopped, UserError

EVENTS = ("on_init_end", "on_train_begin", "on_epoch_begin", "on_step_begin", "on_substep_end",
          "on_pre_optimizer_step", "on_optimizer_step", "on_step_end", "on_log", "on_evaluate", "on_save", "on_load",
          "on_epoch_end", "on_train_end")


@dataclass
class TrainerControl:
    """What callbacks ask of the loop (HF's TrainerControl); reset at every step, agreed by every rank before use."""
    should_training_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def flags(self) -> list[int]:
        return [int(getattr(self, f.name)) for f in fields(self)]

    def set_flags(self, values) -> None:
        for f, value in zip(fields(self), values):
            setattr(self, f.name, bool(value))


@dataclass
class CallbackState:
    """What a callback is told about the run (in part HF's TrainerState, whose names also read)."""
    rank: int
    world_size: int
    total_steps: int
    step: int = 0
    epoch: float = 0.0  # epochs done, fractional, as metrics.jsonl's epoch
    best_metric: float | None = None  # checkpoint.best_metric's best value so far
    best_step: int | None = None

    @property
    def global_step(self) -> int:
        return self.step

    @property
    def max_steps(self) -> int:
        return self.total_steps

    @property
    def is_world_process_zero(self) -> bool:
        return self.rank == 0


class Callback:
    """A base to subclass: every event does nothing, and there is no state to keep."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _event(name: str):
    def event(self, args, state, control, **kwargs):
        pass
    event.__name__ = name
    return event


for _name in EVENTS:
    setattr(Callback, _name, _event(_name))


class EarlyStopping(Callback):
    """Stops training when the metric (checkpoint.best_metric, eval_loss by default) has not improved by more than
    `threshold` for `patience` evaluations in a row (train.early_stopping_patience / early_stopping_threshold; HF's
    EarlyStoppingCallback)."""

    def __init__(self, patience: int, threshold: float = 0.0, metric: str = "eval_loss",
                 greater_is_better: bool = False):
        self.patience, self.threshold = patience, threshold
        self.metric, self.greater_is_better = metric, greater_is_better
        self.best: float | None = None
        self.waited = 0

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.metric not in (metrics or {}):
            return
        value = metrics[self.metric]
        if better(value, self.best, self.greater_is_better, self.threshold):
            self.best, self.waited = value, 0
        else:
            self.waited += 1
        if self.waited >= self.patience:
            control.should_training_stop = True

    def state_dict(self) -> dict:
        return {"best": self.best, "waited": self.waited}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.waited = state["best"], state["waited"]


def import_callback(path: str):
    """`package.module:Class` -> the class (train.callbacks); UserError naming the entry when it cannot be had."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise UserError(f"train.callbacks: {path!r} is not written package.module:Class")
    try:
        found = operator.attrgetter(attribute)(importlib.import_module(module_name))
    except (ImportError, AttributeError) as err:
        raise UserError(f"train.callbacks: cannot import {path!r} ({type(err).__name__}: {err}); make the module "
                        "importable from where llmtune runs (the working directory or PYTHONPATH)") from None
    if not isinstance(found, type):
        raise UserError(f"train.callbacks: {path!r} is not a class; name the callback's class")
    return found


def recipe_callbacks(config) -> list:
    """The callbacks the recipe names: the built-in early stopping (train.early_stopping_patience), then
    train.callbacks' classes, each made without arguments."""
    made = []
    if config.train.early_stopping_patience:
        made.append(EarlyStopping(config.train.early_stopping_patience, config.train.early_stopping_threshold,
                                  config.checkpoint.best_metric, config.checkpoint.greater()))
    for path in config.train.callbacks:
        cls = import_callback(path)
        try:
            made.append(cls())
        except Exception as err:
            raise UserError(f"train.callbacks: {path}() failed ({type(err).__name__}: {err}); a callback named in "
                            "the recipe is made without arguments (give instances to llmtune.train(callbacks=...) "
                            "for others)") from None
    return made


def callback_name(callback) -> str:
    return type(callback).__qualname__


class Callbacks:
    """The run's callbacks, called in order at each event; what they asked (control) and the first error one
    raised on this rank (error), until the trainer's next agreement."""

    def __init__(self, callbacks: list, args, state: CallbackState, objects: dict):
        """objects: the keyword arguments every event gets (model, optimizer, lr_scheduler)."""
        self.callbacks = list(callbacks)
        self.args = args
        self.state = state
        self.objects = objects
        self.control = TrainerControl()
        self.error: str | None = None

    def __call__(self, event: str, **kwargs) -> None:
        for callback in self.callbacks:
            method = getattr(callback, event, None)
            if method is None:
                continue
            try:
                returned = method(self.args, self.state, self.control, **self.objects, **kwargs)
            except Exception as err:
                self.error = self.error or (f"callback {callback_name(callback)} raised in {event}: "
                                            f"{type(err).__name__}: {err}")
                continue
            if isinstance(returned, TrainerControl):
                self.control = returned

    def agree(self, parallel, signal_number: int = 0) -> int:
        """One all-reduce: every rank's control flags, whether a callback raised, and the number of a stop signal a
        rank received, each the highest of any rank. The agreed flags replace this rank's; a callback's error stops
        every rank (its message from the first rank that had one). Returns the agreed signal number."""
        signal_number, raised, *flags = parallel.highest([signal_number, int(self.error is not None),
                                                          *self.control.flags()])
        if raised:
            raise TrainingStopped(parallel.first_error(self.error) + "; the run stopped on every rank")
        self.control.set_flags(flags)
        return signal_number

    def _keeping(self) -> list:
        return [c for c in self.callbacks if hasattr(c, "state_dict") and hasattr(c, "load_state_dict")]

    def state_dict(self) -> list:
        """The state (plain data) of each callback that keeps one, in order, with its class's name."""
        return [{"name": callback_name(c), "state": c.state_dict()} for c in self._keeping()]

    def load_state_dict(self, saved: list) -> None:
        """Back into the callbacks of the same class at the same place among those that keep state; a callback the
        checkpoint has no state for starts as made."""
        for callback, entry in zip(self._keeping(), saved):
            if entry["name"] == callback_name(callback):
                callback.load_state_dict(entry["state"])
