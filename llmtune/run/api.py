"""`llmtune.train`: a run from Python (a script, a notebook), in the calling process: the recipe checked, its Hub ids
fetched and every preflight check made as the CLI makes them, then the same worker, returning the run's result."""

import signal
from contextlib import contextmanager

import yaml

from llmtune.config import SECTIONS, load_config, plain, qualified
from llmtune.errors import UserError
from llmtune.run.launch import world_size_from_env
from llmtune.run.preflight import checked_inputs
from llmtune.run.summary import RunResult
from llmtune.tasks.registry import TASKS

RESUME_CALL = 'the same llmtune.train call with resume_from_checkpoint="auto"'


def yaml_text(value) -> str:
    """`value` as the YAML text an override carries: the CLI's `key=text` reads it back as the same value."""
    return yaml.safe_dump(plain(value), default_flow_style=True, width=float("inf")).removesuffix("\n...\n").strip()


def override_items(overrides: dict, task: str) -> list[str]:
    """Keyword overrides -> the CLI's `section.key=value`: a key as one section has it (`learning_rate=1e-4`, an HF
    Trainer name included), `**{"train.learning_rate": 1e-4}`, or a section's dict (`train={"learning_rate": 1e-4}`)."""
    items = []
    for key, value in overrides.items():
        if key == "nproc":
            raise UserError("nproc: llmtune.train runs in this process; for several, start the script with torchrun "
                            "--nproc-per-node N (each process calls llmtune.train), or use llmtune's --nproc")
        pairs = [(f"{key}.{name}", item) for name, item in value.items()] \
            if key in SECTIONS and isinstance(value, dict) else [(qualified(key, task), value)]
        items += [f"{name}={yaml_text(item)}" for name, item in pairs]
    return items


def run_recipe(task: str, recipe, overrides: dict, callbacks: list) -> RunResult:
    """llmtune.train's work (see its docstring in llmtune/__init__.py)."""
    if task not in TASKS:
        raise UserError(f"task: {task!r} is not a task; use {', '.join(list(TASKS)[:-1])} or {list(TASKS)[-1]}")
    world_size = world_size_from_env()
    config = load_config(recipe, override_items(overrides, task), task, world_size)
    local, _ = checked_inputs(config, world_size)
    from llmtune.run.worker import run  # torch and transformers: imported once the recipe has passed its checks

    with handlers_kept(config.train.save_on_signals):
        return run(config, local, RESUME_CALL, callbacks)


@contextmanager
def handlers_kept(names: list[str]):
    """The calling process's handlers of the stop signals as they were, however the run ends: a run stopped by one
    leaves its own in place (training/stop_signals.py), which a process that goes on after llmtune.train must not
    keep."""
    kept = {name: signal.getsignal(signal.Signals[name]) for name in names}
    try:
        yield
    finally:
        for name, handler in kept.items():
            signal.signal(signal.Signals[name], handler)
