"""Full fine-tuning against LoRA (r 16, alpha 32, all-linear), same pretrained model and data, same run.

    python -m benchmarks.peft [--hidden 1024] [--intermediate 4096] [--layers 12] [--steps N]

A Llama (default: about 190M parameters, fp32) saved with save_pretrained and loaded as a user's pretrained model
(model.name_or_path), pre-trained further (pt) on the demo corpus on 2 processes (torchrun, gloo, CPU); each
variant in a torchrun launch of its own, one after the other, so that each process's peak RSS is its variant's;
activation checkpointing on in both.
Per variant: trainable and total parameters, optimizer-state bytes (per rank, and summed), the size of the one
checkpoint written (at the last step), peak RSS (max over ranks) and the median step time after the warm-up steps.
Then the LoRA / full ratios against their goals: checkpoint <= 0.03, peak RSS <= 0.6, step time <= 0.9.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {"full": {"method": "none"}, "lora": {"method": "lora", "r": 16, "alpha": 32.0,
                                                 "target_modules": "all-linear"}}
GOALS = {"checkpoint_bytes": 0.03, "peak_rss_bytes": 0.6, "step_time_s": 0.9}


def write_recipe(root: Path, variant: str, args, sections: dict) -> Path:
    """root/<variant>.yaml: pt on the demo corpus, the variant's recipe sections (peft, parallel, ...) on top."""
    recipe = root / f"{variant}.yaml"
    steps = args.warmup + args.steps
    recipe.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(root / "model"), "tokenizer": str(root / "assets" / "tokenizer")},
        "data": {"train_files": [str(root / "assets" / "data" / "pt.jsonl")], "max_seq_len": args.seq,
                 "cache_dir": str(root / "cache")},
        "train": {"output_dir": str(root / variant), "max_steps": steps, "per_device_train_batch_size": args.batch,
                  "logging_steps": 1, "learning_rate": 1e-4,
                  # As fine-tuning runs are set up; without it the activations, the same in both variants, would
                  # outweigh the weights of a model this small.
                  "gradient_checkpointing": True},
        # Saved at the last step only, after the timed steps; no export, which is not what is compared.
        "checkpoint": {"save_steps": steps, "export_hf": False},
        "monitor": {"console": False},
        **sections,
    }))
    return recipe


def local_bytes(tensor) -> int:
    """This rank's bytes of `tensor` as stored: a 4-bit NF4 weight's packed values and scales, not its logical size."""
    from torch.distributed.tensor import DTensor

    from llmtune.model.quantize import held, is_quantized, stored_bytes

    if is_quantized(tensor):
        return stored_bytes(held(tensor))
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def peak_rss_bytes() -> int:
    """The process's peak RSS so far (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(variant: str, root: Path, probe=None) -> None:
    """Under torchrun: train the variant; rank 0 writes every rank's figures to root/<variant>.json.
    probe(trainer) -> dict, called once the trainer is built: figures of its own that it may fill while the trainer
    trains (from hooks), added to the rank's."""
    import torch
    import torch.distributed as dist

    from llmtune.config import load_config
    from llmtune.run.parallel import ParallelState
    from llmtune.run.worker import build_trainer

    config = load_config(str(root / f"{variant}.yaml"), [], "pt", int(os.environ["WORLD_SIZE"]))
    state = ParallelState.initialize(config.parallel)
    try:
        baseline = peak_rss_bytes()
        trainer, _ = build_trainer(config, state)
        loaded = peak_rss_bytes()
        figures = probe(trainer) if probe else {}
        trainer.train()
        params = list(trainer.model.parameters())
        mine = {"optimizer_bytes": sum(local_bytes(value) for per_param in trainer.optimizer.state.values()
                                       for value in per_param.values() if isinstance(value, torch.Tensor)),
                # This rank's parameters as stored (a quantized base in its packed form).
                "parameter_bytes": sum(local_bytes(p) for p in params),
                # The whole process's peak, loading and saving included; and the peak before the build (Python,
                # torch, llmtune, the process group) and once the model is loaded, from which a step's share shows.
                "peak_rss_bytes": peak_rss_bytes(), "baseline_rss_bytes": baseline, "load_rss_bytes": loaded,
                "device_peak_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
                **figures}
        ranks = [None] * state.world_size
        dist.all_gather_object(ranks, mine)
        if state.is_main:
            (root / f"{variant}.json").write_text(json.dumps({
                "ranks": ranks, "total_params": sum(p.numel() for p in params),  # a DTensor's numel is global
                "trainable_params": sum(p.numel() for p in params if p.requires_grad)}))
    finally:
        state.close()


def measure(root: Path, variant: str, args, sections: dict, nproc: int = 2, module: str = "benchmarks.peft") -> dict:
    """Train `variant` (its recipe sections) in a launch of `nproc` processes of its own; its figures, with the
    metrics.jsonl records of the steps after the warm-up. module: the benchmark whose --worker trains it."""
    steps = args.warmup + args.steps
    write_recipe(root, variant, args, sections)
    print(f"training {variant} ...", file=sys.stderr, flush=True)
    # As a module, from the repository: run as a file, this folder would come first on sys.path.
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                          "-m", module, "--worker", variant, str(root)], cwd=REPO, capture_output=True,
                         text=True)
    if run.returncode:
        sys.exit(f"the {variant} run failed:\n{run.stderr[-6000:]}")
    result = json.loads((root / f"{variant}.json").read_text())
    records = [json.loads(line) for line in (root / variant / "metrics.jsonl").read_text().splitlines()]
    checkpoint = root / variant / "checkpoints" / f"global_step_{steps}"
    return {**result,
            # logging_steps 1: each record's step_time_s is that one step's (data, forward/backward, optimizer).
            "step_time_s": statistics.median(r["step_time_s"] for r in records[args.warmup:]),
            "records": records[args.warmup:],
            "checkpoint_bytes": sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file()),
            "optimizer_bytes": sum(r["optimizer_bytes"] for r in result["ranks"]),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in result["ranks"])}


def write_model_and_data(root: Path, args, make_model=None) -> None:
    """root/assets: the demo's tokenizer and corpus; root/model: a random model saved as a user's pretrained model,
    make_model(vocab_size)'s (default: a Llama of args' shape: hidden, intermediate, layers)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from llmtune.demo.assets import write_demo_assets

    write_demo_assets(root / "assets")
    vocab = len(AutoTokenizer.from_pretrained(root / "assets" / "tokenizer"))
    torch.manual_seed(0)
    model = make_model(vocab) if make_model else LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.intermediate or 4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=False))
    model.save_pretrained(root / "model")


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, help="default: 4 x hidden")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=10, help="timed steps, after --warmup")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]))
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_model_and_data(root, args)
        results = {variant: measure(root, variant, args, {"peft": sections}) for variant, sections in VARIANTS.items()}
    print(f"Llama hidden {args.hidden}, intermediate {args.intermediate or 4 * args.hidden}, {args.layers} layers, "
          f"fp32, pt seq {args.seq} x batch {args.batch} per rank, 2 processes (gloo, CPU); step time: median of "
          f"{args.steps} steps after {args.warmup}")
    for variant, r in results.items():
        print(f"\n{variant}: {r['trainable_params']:,} trainable of {r['total_params']:,} parameters "
              f"({r['trainable_params'] / r['total_params']:.2%})")
        print(f"  optimizer state: {', '.join(mib(rank['optimizer_bytes']) for rank in r['ranks'])} per rank, "
              f"{mib(r['optimizer_bytes'])} in all")
        print(f"  checkpoint {mib(r['checkpoint_bytes'])}, peak RSS {mib(r['peak_rss_bytes'])} (max over ranks), "
              f"step time {r['step_time_s']:.3f} s")
    print("\nLoRA / full:")
    for key, goal in GOALS.items():
        ratio = results["lora"][key] / results["full"][key]
        print(f"  {key.removesuffix('_s').removesuffix('_bytes'):<10} {ratio:.3f} (goal <= {goal}: "
              f"{'pass' if ratio <= goal else 'FAIL'})")


if __name__ == "__main__":
    # Python puts this file's folder first on sys.path, where this file would stand in for the peft package (for
    # llmtune, and for transformers, which looks for peft when imported).
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    main()
