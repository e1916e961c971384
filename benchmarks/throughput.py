"""Throughput of `llmtune pt` against a plain hand-written FSDP2 loop, same model and data, same run.

    python benchmarks/throughput.py [--steps 30] [--warmup 5] [--seq 512] [--batch 8]

A tiny Llama (the demo's config) pre-trained from scratch on the demo corpus, sequence 512, on 1
and 2 processes, measured two ways:

- Interleaved (what the goal is judged on): in the same torchrun processes, llmtune's training
  loop (built by worker.build_trainer from a recipe, as `llmtune pt` builds it; one
  Trainer.advance is one whole step: data, token counting, forward/backward, clipping, optimizer,
  monitor) and the plain loop take turns, one step each, alternating which goes first. This
  machine's speed drifts by about 10% within seconds (a fixed matmul loop, same process), more
  than the difference being measured; steps taken in turn see the same drift, runs one after the
  other do not. Printed: the plain loop's median step time over llmtune's.
- End to end: `llmtune pt` as a user runs it and the plain loop in a torchrun of its own, one after
  the other: tokens/s and rank 0's peak RSS of each (their ratio carries the drift).

A speed is the tokens of one step over the median step time.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

# The plain loop attends across documents and computes the full logits; llmtune by default keeps
# attention inside each document and chunks the loss. "same work" turns both off.
VARIANTS = {"same work": {"document_mask": False, "chunk_loss_size": 0},
            "defaults": {"document_mask": True, "chunk_loss_size": 1024}}


def write_recipe(assets: Path, out: Path, args, variant: dict, steps: int) -> Path:
    """`out`/recipe.yaml of a `llmtune pt` run of `variant` whose output_dir is `out`."""
    out.mkdir(parents=True)
    recipe = out / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"config": str(assets / "model"), "tokenizer": str(assets / "tokenizer")},
        "data": {"train_files": [str(assets / "data" / "pt.jsonl")], "max_seq_len": args.seq,
                 "cache_dir": str(out.parent / "cache"), "document_mask": variant["document_mask"]},
        "train": {"output_dir": str(out), "max_steps": steps, "per_device_train_batch_size": args.batch,
                  "logging_steps": 1, "learning_rate": 1e-3, "chunk_loss_size": variant["chunk_loss_size"]},
        "checkpoint": {"export_hf": False},
        "monitor": {"console": False},
    }))
    return recipe


def speed(step_times: list[float], tokens_per_step: int) -> float:
    return tokens_per_step / statistics.median(step_times)


def interleaved_worker(assets: Path, recipe: Path, args) -> None:
    """Under torchrun: llmtune's loop built from `recipe` and the plain loop take turns, one step each."""
    from plain_fsdp_loop import PlainLoop

    from llmtune.config import load_config
    from llmtune.parallel import ParallelState
    from llmtune.worker import build_trainer

    state = ParallelState.initialize()
    plain = PlainLoop(str(assets / "model"), str(assets / "tokenizer"), str(assets / "data" / "pt.jsonl"), args.seq,
                      args.batch, state.fsdp_mesh)
    trainer, _ = build_trainer(load_config(str(recipe), [], "pt", state.world_size), state)
    trainer.model.train()
    steps = trainer.data.steps(trainer.total_steps)
    runners = {"plain": plain, "llmtune": lambda: trainer.advance(steps)}
    times = {name: [] for name in runners}
    for step in range(args.warmup + args.steps):
        for name in sorted(runners, reverse=step % 2 == 1):
            started = time.perf_counter()
            runners[name]()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - started)
    if state.is_main:
        print(json.dumps({"step_times_s": times, "tokens_per_step": plain.tokens_per_step}))
    state.close()


def torchrun(nproc: int, *command: str) -> str:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={nproc}", *command], cwd=REPO, check=True, capture_output=True,
                          text=True).stdout.strip().splitlines()[-1]


def interleaved(assets: Path, out: Path, nproc: int, args, variant: dict) -> float:
    """llmtune's tokens/s over the plain loop's, taking turns in the same processes."""
    recipe = write_recipe(assets, out, args, variant, args.warmup + args.steps)
    run = json.loads(torchrun(nproc, __file__, "--worker", str(assets), str(recipe), *common_args(args)))
    return statistics.median(run["step_times_s"]["plain"]) / statistics.median(run["step_times_s"]["llmtune"])


def common_args(args) -> list[str]:
    return [f"--steps={args.steps}", f"--warmup={args.warmup}", f"--seq={args.seq}", f"--batch={args.batch}"]


def end_to_end(assets: Path, out: Path, nproc: int, args) -> dict:
    """{run: (tokens/s, rank 0's peak RSS in GiB)} of separate runs, one after the other."""
    plain = json.loads(torchrun(nproc, str(REPO / "benchmarks" / "plain_fsdp_loop.py"), str(assets / "model"),
                                str(assets / "tokenizer"), str(assets / "data" / "pt.jsonl"), str(args.seq),
                                str(args.batch), str(args.warmup + args.steps), str(args.warmup)))
    results = {"plain": (speed(plain["step_times_s"], plain["tokens_per_step"]), plain["peak_rss_gib"])}
    for name, variant in VARIANTS.items():
        recipe = write_recipe(assets, out / name.replace(" ", "_"), args, variant, args.warmup + args.steps)
        subprocess.run([sys.executable, "-m", "llmtune", "pt", str(recipe), "--nproc", str(nproc)], cwd=REPO,
                       check=True, capture_output=True)
        records = [json.loads(line) for line in (recipe.parent / "metrics.jsonl").read_text().splitlines()]
        # logging_steps 1: each record's tokens/s covers the whole wall time of its step.
        timed = records[args.warmup:]
        results[name] = (speed([r["input_tokens"] / r["tokens_per_s"] for r in timed], timed[0]["input_tokens"]),
                         records[-1]["mem_gib"])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        interleaved_worker(Path(args.worker[0]), Path(args.worker[1]), args)
        return
    from llmtune.demo.assets import write_demo_assets

    with tempfile.TemporaryDirectory() as tmp:
        assets = Path(tmp) / "assets"
        write_demo_assets(assets)
        print(f"tiny Llama (demo config), seq {args.seq}, micro-batch {args.batch} per process, {args.steps} steps "
              f"timed after {args.warmup}; tokens/s = tokens of a step / median step time")
        for nproc in (1, 2):
            print(f"\n{nproc} process(es)")
            ratios = {name: interleaved(assets, Path(tmp) / f"interleaved{nproc}_{name.replace(' ', '_')}", nproc, args,
                                        variant) for name, variant in VARIANTS.items()}
            print("  interleaved with the plain loop: " + ", ".join(
                f"llmtune {name} {ratio:.3f}x" for name, ratio in ratios.items()))
            runs = end_to_end(assets, Path(tmp) / f"end_to_end{nproc}", nproc, args)
            print("  end to end (one after the other): " + ", ".join(
                f"{name} {value:,.0f} tokens/s" + ("" if name == "plain" else f" ({value / runs['plain'][0]:.3f}x)")
                + f", peak RSS {rss:.2f} GiB" for name, (value, rss) in runs.items()))


if __name__ == "__main__":
    main()
