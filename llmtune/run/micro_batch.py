"""A recipe's auto settings, decided once before the first step and the same on every rank from the plan of a
step (plan.auto_settings): train.per_device_train_batch_size: auto, the largest micro-batch whose `llmtune plan`
peak fits the device (train.global_batch_size kept through accumulation), and train.gradient_checkpointing: auto,
the least recompute whose peak fits.

Where they are decided: in the process that starts the run (the CLI, llmtune.train) before any process starts, which
hands them to the workers `--nproc` starts (launch.AUTO_SETTINGS); under a torchrun the user started, every worker
reads the recipe's auto, so rank 0 decides once the process group exists and every rank learns the settings, or the
refusal. The device's memory on CPU is the RAM available at that moment, which two processes would not read alike.
"""

import json
import logging
import os

import torch

from llmtune.run.launch import AUTO_SETTINGS
from llmtune.run.plan import AUTO_CHOICES, USABLE_FRACTION, auto_settings, device_memory_gib, gib

log = logging.getLogger(__name__)


def decide_auto(config, model_config, world_size: int, processes_here: int) -> dict:
    """The auto settings ({key: value}) on world_size ranks, processes_here of them on this node (sharing its RAM on
    CPU), each said in one line."""
    device_gib = device_memory_gib(processes_here)
    decided, plan = auto_settings(config, model_config, world_size, device_gib)
    if torch.cuda.is_available():
        memory = "the device's memory"
    else:
        memory = "the RAM available" + (f" over {processes_here} processes" if processes_here > 1 else "")
    fitting = f"planned peak, {gib(plan.peak)} per rank, fits {USABLE_FRACTION * 100:.0f}% of {device_gib:.2f} GiB, " \
              f"{memory}"
    for key, value in decided.items():
        if key == "train.per_device_train_batch_size":
            value = f"{value} (accumulation {plan.layout.accumulation}, global batch {config.train.global_batch_size})"
        log.info("%s: auto -> %s: %s whose %s", key, value, AUTO_CHOICES[key].removesuffix(" that fits"), fitting)
    return decided


def decide_before_start(config, local, model_config, world_size: int) -> dict:
    """The auto settings resolved in config and local (the recipe as the run reads it) by the process that starts the
    run's world_size ranks on this node, before it starts them (the CLI, llmtune.train, llmtune data); returns them."""
    decided = decide_auto(local, model_config, world_size, world_size)
    for recipe in (config, local):
        recipe.use_auto(decided, world_size)
    return decided


def launch_env(decided: dict) -> dict[str, str]:
    """The environment that hands the decided settings to launch_local's workers."""
    return {AUTO_SETTINGS: json.dumps(decided)} if decided else {}


def agree_auto(config, local, state) -> None:
    """Under torchrun, the auto settings resolved in config and local (the recipe as the run reads it, its model
    folder fetched): to those the launcher decided (--nproc), else to rank 0's decision on its node, which every rank
    learns (or its UserError)."""
    from llmtune.model.build import load_model_config

    processes_here = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    decided = json.loads(os.environ[AUTO_SETTINGS]) if AUTO_SETTINGS in os.environ else state.run_first(
        state.rank == 0, lambda: decide_auto(local, load_model_config(local.model, local.head()), state.world_size,
                                             processes_here), None)
    for recipe in (config, local):
        recipe.use_auto(decided, state.world_size)
