"""Throughput of `llmtune pt` against a plain hand-written FSDP2 loop, same model and data, same run.

    python benchmarks/throughput.py [--steps 25] [--seq 512] [--batch 8]

A tiny Llama (the demo's config) pre-trained from scratch on the demo corpus, sequence 512, on 1
and 2 processes. Prints tokens/s and rank 0's peak RSS of each, and llmtune / plain.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from llmtune.demo.assets import write_demo_assets

REPO = Path(__file__).resolve().parents[1]


# The plain loop attends across documents and computes the full logits; llmtune by default keeps
# attention inside each document and chunks the loss. "same work" turns both off.
VARIANTS = {"same work": {"document_mask": False, "chunk_loss_size": 0},
            "defaults": {"document_mask": True, "chunk_loss_size": 1024}}


def llmtune_run(assets: Path, out: Path, nproc: int, args, variant: dict) -> dict:
    recipe = out / "recipe.yaml"
    out.mkdir(parents=True)
    recipe.write_text(yaml.safe_dump({
        "model": {"config": str(assets / "model"), "tokenizer": str(assets / "tokenizer")},
        "data": {"train_files": [str(assets / "data" / "pt.jsonl")], "max_seq_len": args.seq,
                 "cache_dir": str(out.parent / "cache"), "document_mask": variant["document_mask"]},
        "train": {"output_dir": str(out), "max_steps": args.steps, "per_device_train_batch_size": args.batch,
                  "logging_steps": args.warmup, "learning_rate": 1e-3, "chunk_loss_size": variant["chunk_loss_size"]},
        "checkpoint": {"export_hf": False},
        "monitor": {"console": False},
    }))
    subprocess.run([sys.executable, "-m", "llmtune", "pt", str(recipe), "--nproc", str(nproc)], cwd=REPO, check=True,
                   capture_output=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r["step"] > args.warmup]
    seconds = sum(r["input_tokens"] / r["tokens_per_s"] for r in timed)
    return {"tokens_per_s": sum(r["input_tokens"] for r in timed) / seconds, "peak_rss_gib": records[-1]["mem_gib"]}


def plain_run(assets: Path, nproc: int, args) -> dict:
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                             str(REPO / "benchmarks" / "plain_fsdp_loop.py"), str(assets / "model"),
                             str(assets / "tokenizer"), str(assets / "data" / "pt.jsonl"), str(args.seq),
                             str(args.batch), str(args.steps), str(args.warmup)],
                            cwd=REPO, check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        assets = Path(tmp) / "assets"
        write_demo_assets(assets)
        print(f"tiny Llama (demo config), seq {args.seq}, micro-batch {args.batch}, steps {args.warmup + 1}.."
              f"{args.steps} timed")
        for nproc in (1, 2):
            plain = plain_run(assets, nproc, args)
            print(f"{nproc} process(es): plain FSDP2 loop {plain['tokens_per_s']:,.0f} tokens/s, peak RSS "
                  f"{plain['peak_rss_gib']:.2f} GiB")
            for name, variant in VARIANTS.items():
                ours = llmtune_run(assets, Path(tmp) / f"llmtune{nproc}_{name.replace(' ', '_')}", nproc, args, variant)
                print(f"    llmtune, {name:<9}: {ours['tokens_per_s']:,.0f} tokens/s, peak RSS "
                      f"{ours['peak_rss_gib']:.2f} GiB, {ours['tokens_per_s'] / plain['tokens_per_s']:.3f}x the plain loop")


if __name__ == "__main__":
    main()
