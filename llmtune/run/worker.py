"""What each process runs: wire the parts from the config, top to bottom, train, export."""

import logging
import os
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
from transformers import enable_full_determinism, set_seed

from llmtune.checkpoint.folders import continues, remove_earlier_run
from llmtune.checkpoint.hf_export import export_trained
from llmtune.checkpoint.manager import CheckpointManager
from llmtune.command import command_line
from llmtune.data.collate import pad_token_id
from llmtune.data.manager import build_data
from llmtune.data.templates import recipe_tokenizer
from llmtune.errors import Preempted, TrainingStopped, UserError
from llmtune.features.registry import enabled_features
from llmtune.model.build import base_record, build_model, check_vocab, load_model_config
from llmtune.monitor.console import TRAIN_LOG, close_train_log, configure_logging, open_train_log
from llmtune.monitor.metrics import TrainMonitor, flops_per_token
from llmtune.monitor.plots import plot_run
from llmtune.run.banner import log_start, planned_peak
from llmtune.run.cpu_memory import keep_freed_memory
from llmtune.run.inputs import fetch_hub_inputs, local_inputs, pin_hub_inputs
from llmtune.run.micro_batch import agree_auto
from llmtune.run.parallel import ParallelState
from llmtune.run.preflight import check_run
from llmtune.run.rank_agreement import check_ranks_agree
from llmtune.run.summary import RunResult, run_result, run_summary
from llmtune.run.threads import set_threads
from llmtune.tasks.objective import build_objective
from llmtune.generation.evaluation import GenerationEval
from llmtune.training.callbacks import CallbackArgs, Callbacks, CallbackState, recipe_callbacks
from llmtune.training.ema import EMA
from llmtune.training.optim import build_optimizer, build_scheduler
from llmtune.training.trainer import Trainer

log = logging.getLogger("llmtune")


def fetch_in_turn(config, state: ParallelState):
    """The recipe with its Hub ids fetched (local_inputs), checked, under torchrun, where every process runs the
    CLI: rank 0 pins each revision to a commit, so that every node reads the same one; local rank 0 of each node
    fetches those commits while the other ranks wait (on state.wait_group, which outlasts a long download); then
    every rank reads them from its node's cache."""
    group = state.wait_group
    commits = state.run_first(state.rank == 0, lambda: pin_hub_inputs(config), group)
    state.run_first(state.local_rank == 0, lambda: fetch_hub_inputs(config, commits), group)
    local = local_inputs(config, fetch_hub_inputs(config, commits, local_files_only=True))
    check_run(local, state.world_size)
    return local


def build_trainer(config, state: ParallelState, local=None, callbacks=()) -> tuple[Trainer, object]:
    """(trainer, tokenizer) for this rank, resumed when the recipe says so; rank 0 writes the resolved config, and
    a refusal meanwhile leaves output_dir as it found it (nothing_left_if_refused). local: the recipe with its Hub
    ids fetched (local_inputs), which the run reads; default: config itself. callbacks: callback objects beside those
    the recipe names (llmtune.train's)."""
    local = local or config
    threads = set_threads()
    if config.has_auto():  # under torchrun, where every worker read the recipe's auto
        agree_auto(config, local, state)
    if state.device.type == "cpu":
        keep_freed_memory()
    output_dir = Path(config.train.output_dir)
    if state.is_main and config.train.overwrite_output_dir:
        remove_earlier_run(output_dir)
    with nothing_left_if_refused(output_dir, state.is_main):
        if state.is_main:
            output_dir.mkdir(parents=True, exist_ok=True)
            # A run that goes on from its checkpoints adds to the log of the run it continues.
            open_train_log(output_dir / TRAIN_LOG, continues(output_dir, config.checkpoint.resume_from_checkpoint))
        return wire(config, local, state, callbacks, threads)


@contextmanager
def nothing_left_if_refused(output_dir: Path, is_main: bool):
    """A refused run (UserError, exit 2) writes nothing, also where the refusal is found once the run is being built
    (its data, its model, the ranks' agreement, the checkpoint it resumes): rank 0 takes away what the run added to
    output_dir, the folder itself (and the parents it made) where there was none, else the entries that were not
    there; train.log first ends with the reason, so that a resumed run's log, which was there, tells it."""
    if not is_main:  # rank 0 alone writes there before training
        yield
        return
    created = next((p for p in reversed((output_dir, *output_dir.parents)) if not p.exists()), None)
    before = None if created else set(os.listdir(output_dir))
    try:
        yield
    except UserError as err:
        close_train_log(err)
        for path in [created] if created else [output_dir / n for n in os.listdir(output_dir) if n not in before]:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        raise


def wire(config, local, state: ParallelState, callbacks, threads) -> tuple[Trainer, object]:
    """build_trainer's parts, top to bottom, each from the config and what came before it; threads: set_threads',
    for the banner."""
    output_dir = Path(config.train.output_dir)
    if config.train.deterministic:
        # transformers' own switch (as the HF Trainer's full_determinism): deterministic algorithms, and the
        # cuBLAS workspace setting without which they raise on CUDA.
        enable_full_determinism(config.train.seed)
    # The same seed on every rank: identical initial weights and data order.
    set_seed(config.train.seed)
    tokenizer = recipe_tokenizer(config.task, local.model, config.data)
    model_config = load_model_config(local.model, local.head(), pad_token_id(tokenizer))
    check_vocab(model_config, tokenizer)
    # The banner's plan traces a model of the family on meta tensors: before the features build the run's model,
    # which may patch the family's modeling module for the whole process (Liger replaces its RoPE and RMSNorm by
    # Triton kernels, which launched on meta tensors crashed the first CUDA run with fused kernels).
    peak = planned_peak(local, model_config, state.world_size) if state.is_main else None
    features = enabled_features(config)
    model = build_model(model_config, local.model, config.train, state, features)
    # The task's loss and metrics, and any extra model it needs (a reference); its hook may add to the data.
    objective = build_objective(config, local=local, model_config=model_config, model=model, features=features,
                                state=state, tokenizer=tokenizer)
    data, validation, test = build_data(local, tokenizer, state, objective.annotate, objective.shares_prefixes)
    check_ranks_agree(state, config, data, validation, test, model.hf_model)
    # From here on ranks draw different random numbers (dropout), each from its own stream.
    torch.manual_seed(config.train.seed + state.rank)
    optimizer = build_optimizer(model, config.train)
    total_steps = data.total_steps(config.train)
    scheduler = build_scheduler(optimizer, config.train, total_steps)
    monitor = TrainMonitor(output_dir, config.monitor, config.train.logging_steps, total_steps,
                           flops_per_token(model.hf_model, config.data.max_seq_len), state.world_size, state.rank,
                           {"task": config.task, **config.to_dict()}, objective.unit, objective.shown)
    # Only a run with frozen weights saves the trained part alone, and needs its base to resume.
    frozen = any(not param.requires_grad for param in model.parameters())
    base = base_record(config, local.model, model_config) if frozen else None
    checkpoints = CheckpointManager(output_dir, config.checkpoint, state, config, tokenizer, model.hf_model, base)
    events = Callbacks([*recipe_callbacks(config), *callbacks],
                       CallbackArgs(config, total_steps, state.rank, state.world_size, state.local_rank),
                       CallbackState(state.rank, state.world_size, total_steps, local_rank=state.local_rank,
                                     logging_steps=config.train.logging_steps, eval_steps=config.train.eval_steps,
                                     save_steps=config.checkpoint.save_steps),
                       {"model": model.hf_model, "optimizer": optimizer, "lr_scheduler": scheduler})
    trainer = Trainer(model, objective, optimizer, scheduler, data, validation, monitor, checkpoints, features, state,
                      config.train, total_steps, events, EMA(model, config.train.ema_decays()), test,
                      GenerationEval(local.eval_generation, config.train.eval_steps, tokenizer, model, state,
                                     config.train.seed, output_dir))
    trainer.built()
    checkpoints.restore(trainer)
    if state.is_main:
        # Once every refusal is behind: a refused run writes no config.yaml, nor replaces the one of the run it would
        # have gone on from.
        config.write(output_dir / "config.yaml")
        log_start(trainer, local, state.world_size, peak, threads)
    return trainer, tokenizer


def export(trainer: Trainer, tokenizer, config, state: ParallelState) -> None:
    """The exports at the end of training: each moving average (checkpoint.export_ema; first, as an adapter run's
    merge into output_dir/hf changes the model), then output_dir/hf (and adapter)."""
    output_dir, checkpoint_cfg = Path(config.train.output_dir), config.checkpoint
    for decay in trainer.ema.decays if checkpoint_cfg.export_ema else ():
        with trainer.ema.swapped_in(decay):
            export_trained(trainer.model, tokenizer, output_dir, replace(checkpoint_cfg, export_merged=False),
                           state, trainer.features, f"_ema{trainer.ema.suffix(decay)}")
    if checkpoint_cfg.export_hf:
        export_trained(trainer.model, tokenizer, output_dir, checkpoint_cfg, state, trainer.features)


def run(config, local=None, resume: str = "the same command with checkpoint.resume_from_checkpoint=auto",
        callbacks=()) -> RunResult:
    """The run's result, on every rank. local: the recipe with its Hub ids fetched and checked, or None to fetch them
    here (fetch_in_turn). resume: the command that continues this run, for the summary that ends it and the message
    of a stop by a signal. callbacks: callback objects beside those the recipe names."""
    configure_logging()
    state = ParallelState.initialize(config.parallel)
    started, trainer, outcome, result = time.perf_counter(), None, "failed", None
    try:
        trainer, tokenizer = build_trainer(config, state, local or fetch_in_turn(config, state), callbacks)
        trainer.train()
        if config.checkpoint.export_from == "best":
            trainer.checkpoints.load_best(trainer.model)
        export(trainer, tokenizer, config, state)
        outcome = "finished"
    except Preempted as err:
        outcome = "stopped by a signal"
        raise Preempted(f"{err}; resume with: {resume}") from None
    except TrainingStopped:
        outcome = "stopped (the reason follows)"
        raise
    except KeyboardInterrupt:
        outcome = "interrupted"
        raise
    finally:
        if trainer is not None and state.is_main:
            # plot_run never raises: the run's outcome and error stay as they are. torchrun ends every process soon
            # after one exits with an error: on several processes, a run that did not finish leaves its plots (a
            # second or two) to `llmtune plot`, lest its summary and error be cut off.
            if config.monitor.plots and (outcome == "finished" or state.world_size == 1):
                plot_run(Path(config.train.output_dir))
            elif config.monitor.plots:
                log.info("plots: draw them with: %s", command_line("plot", config.train.output_dir))
            result = run_result(Path(config.train.output_dir), trainer.step, trainer.total_steps,
                                trainer.objective.metric_names())
            log.info("%s", run_summary(result, time.perf_counter() - started, outcome, resume, config.checkpoint))
        if outcome == "finished":  # a failed run raises on every rank: no rank waits for this
            result = state.broadcast_object(result)
        state.close()
        close_train_log(None if outcome == "finished" else sys.exc_info()[1])
    return result
