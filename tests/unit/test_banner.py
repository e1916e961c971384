"""The start banner's lines from a run's numbers, its rows named in the task's unit, its precision, and a plan that
cannot be made said in its line. Its numbers on real runs: tests/e2e/test_console.py (one process),
tests/dist/test_resume.py (two) and, for a task of pairs, tests/e2e/test_dpo.py."""

import dataclasses

from llmtune.config import ParallelConfig, TrainConfig
from llmtune.run import banner
from llmtune.run.banner import Banner, rows_called
from llmtune.tasks.language_model import LanguageModel
from llmtune.tasks.dpo import DPO

FRESH = Banner(rows=1000, unit="samples", steps_per_epoch=62, total_steps=186, first_step=0, global_batch=16,
               micro_batch=4, accumulation=2, dp=2, layout=ParallelConfig().describe(2), params=1234567, trainable=1234000, decay=(14, 1230000),
               no_decay=(29, 4000), precision="fp32", attention="sdpa (through llmtune_documents)",
               checkpointing="selective", peak="12.3 MiB per rank (llmtune plan's estimate for this layout)")


def test_the_banner_says_the_runs_numbers():
    assert FRESH.lines() == [
        "1,000 samples, 3 epochs of 62 steps = 186 optimizer steps",
        "global batch 16 samples = micro-batch 4 x accumulation 2 x 2 data-parallel",
        "layout 2 rank(s) = replicate 1 x shard 2 x cp 1; every parameter sharded over 2 rank(s)",
        "parameters 1,234,567, trainable 1,234,000 (weight decay: 1,230,000 in 14 tensors; no decay: 4,000 in 29)",
        "precision fp32, attention sdpa (through llmtune_documents), activation checkpointing selective",
        "planned peak memory 12.3 MiB per rank (llmtune plan's estimate for this layout)",
    ]


def test_float8_layers_are_counted_in_the_precision_line():
    assert dataclasses.replace(FRESH, precision="bf16 mixed (train.bf16)", float8=14,
                               float8_scaling="tensorwise").lines()[4] == (
        "precision bf16 mixed (train.bf16), float8 matmuls in 14 linear layers (train.fp8 tensorwise), attention sdpa "
        "(through llmtune_documents), activation checkpointing selective")


def test_a_resumed_run_and_a_stream_say_so():
    resumed = dataclasses.replace(FRESH, total_steps=100, first_step=40)
    assert resumed.lines()[0] == "1,000 samples, 1.61 epochs of 62 steps = 100 optimizer steps, resuming after step 40"
    stream = dataclasses.replace(FRESH, rows=None, steps_per_epoch=None, total_steps=50)
    assert stream.lines()[0] == "a stream, 50 optimizer steps (train.max_steps)"


def test_the_layout_says_the_mesh_and_what_differs_from_plain_fsdp():
    """The banner's and llmtune plan's layout: replicate x shard x cp, then offload and the resharding knobs."""
    assert ParallelConfig(cp_size=2).describe(2) == (
        "2 rank(s) = replicate 1 x shard 1 x cp 2; every parameter sharded over 2 rank(s)")
    assert ParallelConfig(dp_replicate=2, cp_size=2, cpu_offload=True).describe(16) == (
        "16 rank(s) = replicate 2 x shard 4 x cp 2; every parameter sharded over 8 rank(s), its 2 copies' gradients "
        "all-reduced once per step; parameters, gradients and optimizer state in CPU memory (parallel.cpu_offload)")
    knobs = ParallelConfig(reshard_after_forward=4, reshard_between_micro_batches=False, prefetch_layers=2)
    assert knobs.describe(8).split("; ")[2:] == [
        "after forward, each layer held by groups of 4 ranks (parallel.reshard_after_forward: 4)",
        "layers gathered and gradients whole between micro-batches (parallel.reshard_between_micro_batches: false)",
        "2 layer(s) prefetched (parallel.prefetch_layers)"]
    kept = ParallelConfig(reshard_after_forward=False, prefetch_layers=0).describe(2).split("; ")[2:]
    assert kept == ["layers stay gathered from forward to backward (parallel.reshard_after_forward: false)",
                    "0 layer(s) prefetched (parallel.prefetch_layers)"]


def test_the_rows_are_named_in_the_objectives_unit():
    """pt's and sft's objective counts its rows as samples (samples_per_s); dpo's data rows are its pairs, which the
    collator packs into each micro-batch's rows."""
    assert rows_called(LanguageModel) == "samples"
    assert rows_called(DPO) == "pairs"
    pairs = dataclasses.replace(FRESH, unit="pairs")
    assert pairs.lines()[:2] == ["1,000 pairs, 3 epochs of 62 steps = 186 optimizer steps",
                                 "global batch 16 pairs = micro-batch 4 x accumulation 2 x 2 data-parallel"]


def test_precision_is_read_from_the_recipe():
    assert banner.precision(TrainConfig(output_dir="out")) == "fp32"
    assert banner.precision(TrainConfig(output_dir="out", bf16=True)) == "bf16 mixed (train.bf16)"
    assert banner.precision(TrainConfig(output_dir="out", fp16=True)) == "fp16 mixed (train.fp16, dynamic loss scaling)"


def test_a_plan_that_cannot_be_made_is_said_in_its_line(monkeypatch):
    def failing_plan(config, model_config, world_size):
        raise ValueError("this class cannot be traced\nmore detail")

    monkeypatch.setattr(banner, "plan_memory", failing_plan)
    assert banner.planned_peak(None, None, 1) == "not computed (ValueError: this class cannot be traced)"
