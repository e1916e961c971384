"""train.per_device_train_batch_size: auto, decided once before the first step and the same on every rank: the
largest micro-batch whose `llmtune plan` peak fits the device (plan.auto_micro_batch), train.global_batch_size kept
through accumulation.

Where it is decided: in the process that starts the run (the CLI, llmtune.train) before any process starts, which
hands its number to the workers `--nproc` starts (launch.MICRO_BATCH); under a torchrun the user started, every worker
reads the recipe's auto, so rank 0 decides once the process group exists and every rank learns its number, or its
refusal. The device's memory on CPU is the RAM available at that moment, which two processes would not read alike.
"""

import logging
import os

import torch

from llmtune.run.launch import MICRO_BATCH
from llmtune.run.plan import USABLE_FRACTION, auto_micro_batch, device_memory_gib, gib

log = logging.getLogger(__name__)


def decide_micro_batch(config, model_config, world_size: int, processes_here: int) -> int:
    """The micro-batch for train.per_device_train_batch_size: auto on world_size ranks, processes_here of them on
    this node (sharing its RAM on CPU), said in one line."""
    device_gib = device_memory_gib(processes_here)
    plan = auto_micro_batch(config, model_config, world_size, device_gib)
    if torch.cuda.is_available():
        memory = "the device's memory"
    else:
        memory = "the RAM available" + (f" over {processes_here} processes" if processes_here > 1 else "")
    log.info("train.per_device_train_batch_size: auto -> %d (accumulation %d, global batch %d): the largest "
             "micro-batch whose planned peak, %s per rank, fits %.0f%% of %.2f GiB, %s", plan.layout.micro_batch,
             plan.layout.accumulation, config.train.global_batch_size, gib(plan.peak), USABLE_FRACTION * 100,
             device_gib, memory)
    return plan.layout.micro_batch


def decide_before_start(config, local, model_config, world_size: int) -> None:
    """auto resolved in config and local (the recipe as the run reads it) by the process that starts the run's
    world_size ranks on this node, before it starts them (the CLI, llmtune.train, llmtune data)."""
    micro_batch = decide_micro_batch(local, model_config, world_size, world_size)
    for recipe in (config, local):
        recipe.use_micro_batch(micro_batch, world_size)


def agree_micro_batch(config, local, state) -> None:
    """Under torchrun, auto resolved in config and local (the recipe as the run reads it, its model folder fetched):
    to the micro-batch the launcher decided (--nproc), else to rank 0's decision on its node, which every rank learns
    (or its UserError)."""
    from llmtune.model.build import load_model_config

    processes_here = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    micro_batch = int(os.environ[MICRO_BATCH]) if MICRO_BATCH in os.environ else state.run_first(
        state.rank == 0, lambda: decide_micro_batch(local, load_model_config(local.model, local.head()), state.world_size,
                                                    processes_here), None)
    for recipe in (config, local):
        recipe.use_micro_batch(micro_batch, state.world_size)
