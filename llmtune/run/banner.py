"""The start banner: what a run is about to do, a block of lines that rank 0 logs once the run is built, before its
first step (through logging, so that output_dir/train.log holds it too): the data (its rows, named in the task's
unit) and the optimizer steps, the global batch and the layout, the parameters (those held in nf4, and the frozen
linear weights nf4 cannot hold) and their weight-decay groups, the precision, the attention backend the model
resolved, and the peak memory per rank that `llmtune plan` computes for this layout."""

import logging
from dataclasses import dataclass

from llmtune.data.manager import StreamingDataManager
from llmtune.features.float8 import float8_layer_count
from llmtune.model.build import decoder_layers
from llmtune.model.multimodal import text_attention
from llmtune.model.quantize import GROUP, frozen_linears, is_quantized
from llmtune.run.plan import gib, plan_memory
from llmtune.training.optim import group_sizes

log = logging.getLogger("llmtune")


@dataclass(frozen=True)
class Banner:
    rows: int | None  # the rows of an epoch (after packing); None for a stream
    unit: str  # what the rows are called: rows_called
    steps_per_epoch: int | None  # None for a stream
    total_steps: int
    first_step: int  # the step a resumed run goes on from; 0 for a fresh one
    global_batch: int
    micro_batch: int
    accumulation: int
    dp: int
    layout: str  # ParallelConfig.describe
    params: int  # whole-model counts, not one rank's shard
    trainable: int
    decay: tuple[int, int]  # (tensors, elements) of the optimizer's weight-decay group
    no_decay: tuple[int, int]
    precision: str
    attention: str
    checkpointing: str  # train.gradient_checkpointing's mode (TrainConfig.checkpointing)
    peak: str  # the plan's peak per rank, or why there is none
    threads: str = ""  # torch's intra-op threads and why (run/threads.set_threads)
    quantized: int = 0  # parameters held in nf4 (model.quantize), whole-model count
    kept: int = 0  # model.quantize: those of the frozen linear weights nf4 cannot hold (not whole groups)
    float8: int = 0  # train.fp8: the linear layers that compute in float8
    float8_scaling: str | None = None  # and with which scaling (config.FLOAT8_SCALINGS)
    batch: str | None = None  # the objective's own words for the global batch (Objective.global_batch_words)
    recipe_defaults: tuple[str, ...] = ()  # LLaMA-Factory's defaults a flat recipe took (Config.recipe_defaults)

    def lines(self) -> list[str]:
        if self.rows is None:
            data = f"a stream, {self.total_steps} optimizer steps (train.max_steps)"
        else:
            epochs = self.total_steps / self.steps_per_epoch
            data = (f"{self.rows:,} {self.unit}, {epochs:.3g} epochs of {self.steps_per_epoch} steps = "
                    f"{self.total_steps} optimizer steps")
        if self.first_step:
            data += f", resuming after step {self.first_step}"
        return [
            data,
            f"global batch {self.batch or f'{self.global_batch} {self.unit}'} = micro-batch {self.micro_batch} x "
            f"accumulation {self.accumulation} x {self.dp} data-parallel",
            f"layout {self.layout}",
            f"parameters {self.params:,}, trainable {self.trainable:,} (weight decay: {self.decay[1]:,} in "
            f"{self.decay[0]} tensors; no decay: {self.no_decay[1]:,} in {self.no_decay[0]})"
            + (f"; {self.quantized:,} frozen in nf4 (model.quantize)" if self.quantized else "")
            + (f", {self.kept:,} frozen in the compute dtype (linear weights of no whole number of {GROUP:,}-value "
               "groups, which nf4 cannot hold)" if self.kept else ""),
            f"precision {self.precision}"
            + (f", float8 matmuls in {self.float8} linear layers (train.fp8 {self.float8_scaling})" if self.float8
               else "")
            + f", attention {self.attention}, activation checkpointing {self.checkpointing}",
            f"planned peak memory {self.peak}",
        ] + ([f"threads {self.threads}"] if self.threads else []) + ([f"LLaMA-Factory recipe: its defaults for {', '.join(self.recipe_defaults)}"]
             if self.recipe_defaults else [])


def rows_called(objective) -> str:
    """The banner's name for the data rows a step is cut from: the objective's unit (metrics.jsonl's samples_per_s
    or pairs_per_s: pt's and sft's rows, dpo's and rm's pairs, kto's examples, each one data row until the collator
    packs a micro-batch's), or its own name of them where it has one (grpo's prompts)."""
    return objective.rows_called or objective.unit


def precision(train_cfg) -> str:
    """The run's precision as the banner names it, read from the recipe here alone."""
    half = train_cfg.half_precision()
    return f"{half} mixed (train.{half}{', dynamic loss scaling' if half == 'fp16' else ''})" if half else "fp32"


def planned_peak(config, model_config, world_size: int) -> str:
    """`llmtune plan`'s peak of a step per rank for this run's layout. The banner only informs: a plan that cannot
    be made is said in the line, and the run goes on."""
    try:
        plan = plan_memory(config, model_config, world_size)
    except Exception as err:
        reason = str(err).splitlines()[0] if str(err) else ""
        return f"not computed ({type(err).__name__}{': ' if reason else ''}{reason})"
    return f"{gib(plan.peak)} per rank (llmtune plan's estimate for this layout)"


def start_banner(trainer, config, world_size: int, peak: str, threads: str = "") -> Banner:
    """The banner of a built (and, if it resumes, restored) trainer. config: the recipe as the run reads it (Hub ids
    fetched); peak: planned_peak's line, made before the model was built; threads: set_threads' line."""
    data, model = trainer.data, trainer.model
    stream = isinstance(data, StreamingDataManager)
    # A DTensor's numel is the whole parameter's: the counts are the model's on any number of ranks.
    params = list(model.parameters())
    groups = group_sizes(trainer.optimizer)
    attention = model.attention
    wrapper = text_attention(model.hf_model)
    if wrapper != model.attention:
        attention += f" (through {wrapper})"
    return Banner(
        rows=None if stream else data.sampler.size, unit=rows_called(trainer.objective),
        steps_per_epoch=None if stream else data.steps_per_epoch,
        total_steps=trainer.total_steps, first_step=trainer.step, global_batch=data.global_batch,
        micro_batch=config.train.per_device_train_batch_size, accumulation=config.train.gradient_accumulation_steps,
        dp=config.dp_size(world_size), layout=config.parallel.describe(world_size),
        params=sum(p.numel() for p in params), trainable=sum(p.numel() for p in params if p.requires_grad),
        decay=groups["decay"], no_decay=groups["no_decay"], precision=precision(config.train), attention=attention,
        checkpointing=config.train.checkpointing(), float8=float8_layer_count(model.hf_model) if config.train.fp8 else 0,
        float8_scaling=config.train.float8_scaling(),
        peak=peak, threads=threads,
        batch=trainer.objective.global_batch_words(data.global_batch),
        quantized=sum(p.numel() for p in params if is_quantized(p)),
        kept=sum(linear.weight.numel() for linear in frozen_linears(model.hf_model, decoder_layers(model.hf_model))
                 .values() if not is_quantized(linear.weight)) if config.model.quantize != "none" else 0,
        recipe_defaults=tuple(config.recipe_defaults))


def log_start(trainer, config, world_size: int, peak: str, threads: str = "") -> None:
    for line in start_banner(trainer, config, world_size, peak, threads).lines():
        log.info("start: %s", line)
