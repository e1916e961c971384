"""Context parallelism: per-rank peak memory and step time of one training step at growing sequence
lengths, cp=1 (one process) against cp=2 (two processes), on a small Llama; and the longest
sequence each fits under a memory cap.

    python benchmarks/context_parallel.py [--lengths 2048 4096 8192 16384] [--cap-gib 1.5]

Each (length, cp) case runs in fresh processes; memory is each rank's peak RSS growth during the
step (activations, gradients, optimizer state are what grows; the model is built before).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def step_case(model_dir: str, length: int, out: str) -> None:
    """Under torchrun: one forward+backward+optimizer step on one sequence of `length` tokens."""
    import torch

    from llmtune.config import ModelConfig, TrainConfig
    from llmtune.features.ulysses import SequenceShard, register_attention
    from llmtune.loss import shift_labels
    from llmtune.model import build_model
    from llmtune.parallel import ParallelState

    cp = int(os.environ["WORLD_SIZE"])
    state = ParallelState.initialize(cp)
    attention = register_attention(state.cp_group, "sdpa") if cp > 1 else "sdpa"
    model = build_model(ModelConfig(config=model_dir, tokenizer=model_dir), TrainConfig(), state.fsdp_mesh,
                        state.device, attention)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (1, length), generator=generator)
    inputs = {"input_ids": ids, "shift_labels": shift_labels(ids)}
    if cp > 1:
        inputs = SequenceShard(state.cp_group, cp, state.cp_rank, 0)(inputs)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    model(**inputs).backward()
    optimizer.step()
    seconds = time.perf_counter() - started
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 2**20
    with open(out, "a") as f:
        f.write(json.dumps({"rank": state.rank, "peak_growth_gib": grown, "seconds": seconds}) + "\n")
    state.close()


def run(model_dir: Path, length: int, cp: int, tmp: Path) -> dict:
    out = tmp / f"case_{length}_{cp}.jsonl"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}",
                             __file__, "--case", str(model_dir), str(length), str(out)], cwd=REPO,
                            capture_output=True, text=True)
    if result.returncode:
        return {"failed": result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"}
    ranks = [json.loads(line) for line in out.read_text().splitlines()]
    return {"peak_growth_gib": max(r["peak_growth_gib"] for r in ranks), "seconds": max(r["seconds"] for r in ranks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--cap-gib", type=float, default=1.5)
    parser.add_argument("--case", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        step_case(args.case[0], int(args.case[1]), args.case[2])
        return
    from transformers import LlamaConfig

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=4, max_position_embeddings=max(args.lengths)).save_pretrained(model_dir)
        print(f"Llama hidden 256, 4 layers, 8 heads (4 kv), fp32, batch 1; cap {args.cap_gib} GiB per rank")
        print(f"{'tokens':>8} | {'cp=1 GiB':>9} {'s':>7} | {'cp=2 GiB/rank':>13} {'s':>7} | {'memory cp2/cp1':>14}")
        fits = {1: 0, 2: 0}
        for length in args.lengths:
            one, two = run(model_dir, length, 1, Path(tmp)), run(model_dir, length, 2, Path(tmp))
            for cp, result in ((1, one), (2, two)):
                if "failed" not in result and result["peak_growth_gib"] <= args.cap_gib:
                    fits[cp] = length

            def show(r):
                return f"{'failed':>9} {'':>7}" if "failed" in r else f"{r['peak_growth_gib']:9.2f} {r['seconds']:7.1f}"

            ratio = two["peak_growth_gib"] / one["peak_growth_gib"] if "failed" not in one and "failed" not in two \
                else float("nan")
            print(f"{length:>8} | {show(one)} | {show(two):>21} | {ratio:14.2f}")
        print(f"longest sequence under {args.cap_gib} GiB per rank: cp=1 {fits[1]}, cp=2 {fits[2]} tokens")


if __name__ == "__main__":
    main()
