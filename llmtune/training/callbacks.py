"""Callbacks: user code at the HF Trainer's named points of the loop, and the control through which it steers the run.

A callback is any object with some of the EVENTS as methods (subclassing Callback, or transformers' TrainerCallback,
is optional), called on every rank as the HF Trainer calls its TrainerCallback: `on_step_end(args, state, control,
**kwargs)`, args a CallbackArgs (the run's Config, which also answers TrainingArguments' names), state a
CallbackState (rank, world size, step, epoch, log_history, ...), control the TrainerControl, and in kwargs the model,
optimizer and lr_scheduler plus what the event carries (on_pre_optimizer_step: grad_norm, on_evaluate: metrics,
on_log: logs (edit it to change the record), on_save and on_load: checkpoint). A callback may set the control's
flags, or return a TrainerControl as HF's do.

A flag set on one rank acts on all: the trainer agrees on them (one all-reduce of every rank's flags) before it
acts, so one rank's early stop stops every rank at the same step. A callback that raises stops the run on every
rank at that agreement, with its name and message (TrainingStopped, exit 1); nothing is saved then, the last
checkpoint stays the one to resume from. A callback's state_dict() (plain data) is kept in every checkpoint's
trainer_state.json and given back to load_state_dict() on resume.
"""

import dataclasses
import functools
import json
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path

from transformers.trainer_utils import IntervalStrategy, SaveStrategy, SchedulerType
from transformers.training_args import OptimizerNames, TrainingArguments

from llmtune.checkpoint.best import better
from llmtune.errors import TrainingStopped, UserError
from llmtune.training.optim import schedule
from llmtune.user_code import import_named

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
    local_rank: int = 0
    logging_steps: int = 0  # train.logging_steps, eval_steps and checkpoint.save_steps (0: none)
    eval_steps: int = 0
    save_steps: int = 0
    # Every record logged, as the HF Trainer's log_history holds them (hf_log_entries); in every checkpoint.
    log_history: list[dict] = field(default_factory=list)
    # HF's hyperparameter search, which llmtune has none of: its integrations read these.
    is_hyper_param_search = False
    trial_name = None
    trial_params = None

    @property
    def global_step(self) -> int:
        return self.step

    @property
    def max_steps(self) -> int:
        return self.total_steps

    @property
    def best_global_step(self) -> int | None:
        return self.best_step

    @property
    def is_world_process_zero(self) -> bool:
        return self.rank == 0

    @property
    def is_local_process_zero(self) -> bool:
        return self.local_rank == 0


# metrics.jsonl's names that the HF Trainer logs under another.
HF_LOG_NAMES = {"lr": "learning_rate"}


def hf_log_entries(record: dict) -> list[dict]:
    """A metrics.jsonl record as the HF Trainer's log_history holds it: HF's names, and the training values and an
    evaluation's (eval_*, test_*) each an entry of their own, with the step and epoch."""
    where = {"epoch": record["epoch"], "step": record["step"]}
    evaluation = {key: value for key, value in record.items() if key.startswith(("eval_", "test_"))}
    training = {HF_LOG_NAMES.get(key, key): value for key, value in record.items()
                if key not in evaluation and key not in where}
    return [{**values, **where} for values in (training, evaluation) if values]


def training_arguments(config, total_steps: int) -> dict:
    """The HF TrainingArguments' values of the run the recipe describes, by their names: those the HF Trainer would
    hold for the same run, of the same types (report_to a list, max_steps -1 when unset, the strategies and
    schedule as transformers' enums); also transformers 4's logging_dir, warmup_ratio and overwrite_output_dir."""
    train, checkpoint, monitor, data = config.train, config.checkpoint, config.monitor, config.data
    scheduler, _, scheduler_kwargs = schedule(train, total_steps)
    evaluation = (IntervalStrategy.STEPS if train.eval_steps else IntervalStrategy.EPOCH if train.eval_epochs
                  else IntervalStrategy.NO)
    return {
        "output_dir": train.output_dir, "overwrite_output_dir": train.overwrite_output_dir,
        "logging_dir": str(Path(train.output_dir) / "tensorboard"),  # monitor.report_to's tensorboard folder
        "per_device_train_batch_size": train.per_device_train_batch_size,
        "per_device_eval_batch_size": train.per_device_eval_batch_size,
        "gradient_accumulation_steps": train.gradient_accumulation_steps,
        "num_train_epochs": train.num_train_epochs, "max_steps": train.max_steps,
        "learning_rate": train.learning_rate, "lr_scheduler_type": SchedulerType(scheduler),
        "lr_scheduler_kwargs": scheduler_kwargs or None,
        # transformers 5 reads a warmup_steps below 1 as a ratio, which replaced warmup_ratio.
        "warmup_steps": train.warmup_steps or train.warmup_ratio, "warmup_ratio": train.warmup_ratio,
        "optim": OptimizerNames.ADAMW_TORCH_FUSED, "weight_decay": train.weight_decay,
        "adam_beta1": train.adam_beta1, "adam_beta2": train.adam_beta2, "adam_epsilon": train.adam_epsilon,
        "max_grad_norm": train.max_grad_norm, "label_smoothing_factor": train.label_smoothing,
        "bf16": train.bf16, "fp16": train.fp16, "gradient_checkpointing": train.checkpointing() != "none",
        "activation_checkpointing": train.checkpointing() != "none", "torch_compile": train.compile,
        "use_liger_kernel": train.fused_kernels,
        "full_determinism": train.deterministic, "seed": train.seed,
        "logging_strategy": IntervalStrategy.STEPS, "logging_steps": train.logging_steps,
        "eval_strategy": evaluation, "do_eval": evaluation != IntervalStrategy.NO,
        "eval_steps": train.eval_steps or None, "eval_on_start": train.eval_on_start,
        "save_strategy": SaveStrategy.STEPS if checkpoint.save_steps else SaveStrategy.EPOCH if checkpoint.save_epochs
        else SaveStrategy.NO,
        "save_steps": checkpoint.save_steps, "save_total_limit": checkpoint.save_total_limit,
        "save_only_model": checkpoint.save_only_model, "resume_from_checkpoint": checkpoint.resume_from_checkpoint,
        "load_best_model_at_end": checkpoint.export_from == "best", "metric_for_best_model": checkpoint.best_metric,
        "greater_is_better": checkpoint.greater(),
        "report_to": list(monitor.report_to), "run_name": monitor.run_name, "project": monitor.project or "llmtune",
        "dataloader_num_workers": data.num_workers, "dataloader_pin_memory": data.pin_memory,
        "dataloader_persistent_workers": data.persistent_workers,
        "dataloader_prefetch_factor": data.prefetch_factor,
    }


class CallbackArgs:
    """A callback's `args`: the run's Config (args.train.output_dir, args.task, ...) that also answers the HF
    TrainingArguments' names (args.output_dir, args.learning_rate, ...: training_arguments), so that a callback
    written for the HF Trainer runs as written. A TrainingArguments field llmtune has no setting for gives its HF
    default (push_to_hub False, ...)."""

    def __init__(self, config, total_steps: int, rank: int = 0, world_size: int = 1, local_rank: int = 0):
        self.config = config
        self.values = training_arguments(config, total_steps)
        # TrainingArguments' properties of the process, which its to_dict leaves out.
        self.world_size, self.process_index, self.local_process_index = world_size, rank, local_rank
        self.train_batch_size = self.values["per_device_train_batch_size"]
        self.eval_batch_size = self.values["per_device_eval_batch_size"]

    def __getattr__(self, name: str):
        if name.startswith("_") or name in ("config", "values"):  # not built yet (copy, pickle)
            raise AttributeError(name)
        if name in self.values:
            return self.values[name]
        if hasattr(self.config, name):
            return getattr(self.config, name)
        defaults = hf_defaults()
        if name in defaults:
            return defaults[name]
        raise AttributeError(f"callback args: {name!r} is neither a recipe section nor a TrainingArguments name")

    def to_dict(self) -> dict:
        """As TrainingArguments.to_dict (every field, enums as their values), and the recipe's sections."""
        values = {**hf_defaults(), **self.values}
        return {**{key: value.value if isinstance(value, Enum) else value for key, value in values.items()},
                **self.config.to_dict()}

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_sanitized_dict(self) -> dict:
        """As TrainingArguments.to_sanitized_dict, for TensorBoard's hparams: values other than bool, int, float and
        str as their str."""
        values = {**self.to_dict(), "train_batch_size": self.train_batch_size, "eval_batch_size": self.eval_batch_size}
        return {key: value if type(value) in (bool, int, float, str) else str(value) for key, value in values.items()}

    def __repr__(self) -> str:
        return f"CallbackArgs({self.values})"


@functools.cache
def hf_defaults() -> dict:
    """TrainingArguments' fields with their defaults."""
    return {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(TrainingArguments) if f.init}


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
    found = import_named(path, "train.callbacks")
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
