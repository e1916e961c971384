"""`llmtune plan` against the run: the predicted peak of a training step per rank next to the peak the step
measures, on CPU, for layouts of 1 and 2 ranks, activation checkpointing none, selective and full, and context
parallelism; then, for a mixture of experts, 2 ranks with and without expert parallelism. --only: the cases whose
name holds TEXT (e.g. "1 rank"), for a shorter run.

    python -m benchmarks.plan_accuracy [--seq-len 1024] [--layers 4] [--only TEXT]

(as a module: run as a file, its folder would come first on sys.path, where benchmarks/peft.py stands in for peft)

Each case: llmtune's model, optimizer and Trainer.train_step on random tokens, two steps to warm up (the second
has AdamW's moments), then one measured step. Its peak is counted in tensors, as benchmarks/context_parallel.py
counts it: the bytes live before the step (every storage of the parameters, buffers and optimizer state) plus the
profiler's highest total of bytes allocated during the step (less what earlier cases left in that total). The
largest rank is shown. The 2-rank cases run one after another in one launch (torchrun, whose start-up takes
seconds), the 1-rank ones in this process. tests/dist/test_plan_peaks.py holds some of these cases to 25%.
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
# (name, recipe overrides, ranks)
CASES = [
    ("1 rank", [], 1),
    ("1 rank, checkpointing", ["train.gradient_checkpointing=true"], 1),
    ("1 rank, selective checkpointing", ["train.gradient_checkpointing=selective"], 1),
    ("2 ranks", [], 2),
    ("2 ranks, checkpointing", ["train.gradient_checkpointing=true"], 2),
    ("2 ranks, selective checkpointing", ["train.gradient_checkpointing=selective"], 2),
    ("2 ranks, cp=2", ["parallel.cp_size=2"], 2),
    ("2 ranks, cp=2, checkpointing", ["parallel.cp_size=2", "train.gradient_checkpointing=true"], 2),
    ("1 rank, full logits", ["train.chunk_loss_size=0"], 1),
    ("2 ranks, layers kept gathered after forward", ["parallel.reshard_after_forward=false"], 2),
    ("2 ranks, no resharding between micro-batches", ["parallel.reshard_between_micro_batches=false"], 2),
    ("2 ranks, 2 layers prefetched", ["parallel.prefetch_layers=2"], 2),
]
# The mixture of experts' (write_model with EXPERTS): its experts are most of its weights, the gathered layer's too.
EXPERTS = 32
MOE_CASES = [
    ("2 ranks", [], 2),
    ("2 ranks, ep 2", ["parallel.expert_parallel=2"], 2),
    ("2 ranks, checkpointing", ["train.gradient_checkpointing=true"], 2),
    ("2 ranks, ep 2, checkpointing", ["parallel.expert_parallel=2", "train.gradient_checkpointing=true"], 2),
]


def write_model(folder: Path, layers: int, seq_len: int, experts: int = 0) -> None:
    """A Llama, or with `experts` a Qwen3-MoE of the same attention, vocabulary and hidden size whose layers each
    have that many experts of 256, two per token."""
    from transformers import LlamaConfig, Qwen3MoeConfig

    shape = dict(vocab_size=2048, hidden_size=256, num_hidden_layers=layers, num_attention_heads=8,
                 num_key_value_heads=4, max_position_embeddings=seq_len)
    config = Qwen3MoeConfig(**shape, head_dim=32, num_experts=experts, num_experts_per_tok=2,
                            moe_intermediate_size=256) if experts else LlamaConfig(**shape, intermediate_size=688)
    config.save_pretrained(folder)


def case_config(model_dir: str, seq_len: int, overrides: list[str], world_size: int):
    """The recipe of a case, loaded as the run loads it."""
    from llmtune.config import load_config

    # A file of this call's own: every rank of a case calls this at once, and a file shared by them was read while
    # another rank was rewriting it (a half-written recipe, refused).
    with tempfile.TemporaryDirectory() as folder:
        recipe = Path(folder) / "recipe.yaml"
        # Data and output folder are named because a recipe must name them; the measurement reads and writes
        # neither.
        recipe.write_text(yaml.safe_dump({
            "model": {"config": model_dir, "tokenizer": model_dir},
            "data": {"train_files": ["unused.jsonl"], "max_seq_len": seq_len},
            "train": {"output_dir": "unused", "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
                      "chunk_loss_size": 512}}))
        return load_config(str(recipe), overrides, "pt", world_size)


def measure(config, keep_process_group: bool = False) -> int:
    """Under torchrun (or one process): the peak bytes of this rank in one steady training step of `config`.
    keep_process_group: leave the process group for the next case (a torchrun worker cannot join a second)."""
    return sum(measure_parts(config, keep_process_group))


def measure_parts(config, keep_process_group: bool = False) -> tuple[int, int]:
    """measure's two parts: (the bytes held before the step: parameters, buffers, optimizer state; the highest
    total the step allocates on top of them)."""
    import torch

    from llmtune.data.collate import MicroBatch
    from llmtune.features.registry import enabled_features
    from llmtune.model.build import build_model, load_model_config
    from llmtune.model.loss import shift_labels
    from llmtune.run.parallel import ParallelState
    from llmtune.training.callbacks import Callbacks, CallbackState
    from llmtune.training.ema import EMA
    from llmtune.training.optim import build_optimizer, build_scheduler
    from llmtune.tasks.language_model import LanguageModel
    from llmtune.training.trainer import Trainer

    state = ParallelState.initialize(config.parallel)
    features = enabled_features(config)
    model = build_model(load_model_config(config.model), config.model, config.train, state, features)
    optimizer = build_optimizer(model, config.train)
    # Only train_step runs: no data, validation, monitor or checkpoints, no callbacks, no moving averages.
    trainer = Trainer(model, LanguageModel(), optimizer, build_scheduler(optimizer, config.train, 10), None, None, None,
                      None, features,
                      state, config.train, 10, Callbacks([], config, CallbackState(state.rank, state.world_size, 10), {}),
                      EMA(model, []), None, None)
    generator = torch.Generator().manual_seed(state.dp_rank)
    shape = (config.train.per_device_train_batch_size, config.data.max_seq_len)

    def micro_batch():
        ids = torch.randint(3, 2000, shape, generator=generator)
        return MicroBatch({"input_ids": ids, "shift_labels": shift_labels(ids)}, ids.numel())

    for _ in range(2):
        trainer.train_step(trainer.prepare([micro_batch() for _ in range(config.train.gradient_accumulation_steps)]))
    batches = [micro_batch() for _ in range(config.train.gradient_accumulation_steps)]
    held = {}
    tensors = [*model.parameters(), *model.buffers(),
               *(t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))]
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        held[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    # The profiler's total starts from what earlier profilers of this process saw allocated and not freed while they
    # ran (an earlier case's tensors; nothing in a fresh process), read from one allocation profiled alone; the garbage
    # of an earlier case is collected first, lest the step free some of it while it is profiled.
    gc.collect()
    first = profiled_memory(lambda: torch.empty(1))[0]
    earlier = first["Total Allocated"] - first["Bytes"]
    during = max((m["Total Allocated"] for m in profiled_memory(lambda: trainer.train_step(trainer.prepare(batches)))),
                 default=earlier) - earlier
    if not keep_process_group:
        state.close()
    return sum(held.values()), during


def profiled_memory(work) -> list[dict]:
    """The profiler's memory events (their args) while work() runs."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            work()
        prof.export_chrome_trace(f"{tmp}/trace.json")
        events = json.loads(Path(f"{tmp}/trace.json").read_text())["traceEvents"]
    return [e["args"] for e in events if e.get("name") == "[memory]"]


def predicted(config, world_size: int) -> int:
    from llmtune.model.build import load_model_config
    from llmtune.run.plan import plan_memory

    return plan_memory(config, load_model_config(config.model), world_size).peak


def measure_cases(model_dir: Path, seq_len: int, cases: list[tuple[list[str], int]], folder: Path) -> list[int]:
    """The measured peak of each (overrides, ranks) case, the largest over its ranks. The cases of one rank count
    share one launch, where they run one after another; those of one rank run in this process, which a launch would
    only add its start-up to. folder: where the ranks write their peaks."""
    peaks = {}
    for ranks in sorted({ranks for _, ranks in cases}):
        numbers = [number for number, (_, r) in enumerate(cases) if r == ranks]
        overrides = [cases[number][0] for number in numbers]
        if ranks == 1:
            found = [measure(case_config(str(model_dir), seq_len, o, 1)) for o in overrides]
        else:
            found = launched_cases(model_dir, seq_len, overrides, ranks, folder / f"peaks_{ranks}.jsonl")
        peaks.update(zip(numbers, found))
    return [peaks[number] for number in range(len(cases))]


def launched_cases(model_dir: Path, seq_len: int, cases: list[list[str]], ranks: int, out: Path) -> list[int]:
    """The measured peaks of cases (overrides) on `ranks` processes of one torchrun launch."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "-m", "benchmarks.plan_accuracy", "--cases", str(model_dir), str(seq_len), str(out), json.dumps(cases)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    peaks = [0] * len(cases)
    for line in out.read_text().splitlines():
        record = json.loads(line)
        peaks[record["case"]] = max(peaks[record["case"]], record["peak"])
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--only", default="", help="the cases whose name holds this text alone")
    parser.add_argument("--cases", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cases:
        model_dir, seq_len, out, cases = args.cases
        cases = json.loads(cases)
        for number, overrides in enumerate(cases):
            config = case_config(model_dir, int(seq_len), overrides, int(os.environ["WORLD_SIZE"]))
            peak = measure(config, keep_process_group=number < len(cases) - 1)
            with open(out, "a") as f:
                f.write(json.dumps({"case": number, "peak": peak}) + "\n")
        return
    for model, experts, cases in (("Llama", 0, CASES),
                                  (f"Qwen3-MoE of {EXPERTS} experts of 256 (2 per token),", EXPERTS, MOE_CASES)):
        cases = [case for case in cases if args.only in case[0]]
        if not cases:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = Path(tmp) / "model"
            write_model(model_dir, args.layers, args.seq_len, experts)
            print(f"\n{model} hidden 256, {args.layers} layers, vocab 2048, fp32, micro-batch 2 x {args.seq_len} "
                  "tokens, accumulation 2, chunked loss 512; MiB per rank")
            print(f"| {'layout':<33} | {'predicted':>9} | {'measured':>9} | {'predicted / measured':>20} |")
            print(f"|{'-' * 35}|{'-' * 11}:|{'-' * 11}:|{'-' * 22}:|")
            measured_peaks = measure_cases(model_dir, args.seq_len,
                                           [(overrides, ranks) for _, overrides, ranks in cases], Path(tmp))
            for (name, overrides, ranks), measured in zip(cases, measured_peaks):
                plan = predicted(case_config(str(model_dir), args.seq_len, overrides, ranks), ranks)
                print(f"| {name:<33} | {plan / 2**20:9.1f} | {measured / 2**20:9.1f} | {plan / measured:20.2f} |",
                      flush=True)


if __name__ == "__main__":
    main()
