"""Tensor parallelism's memory on CPU processes (4 ranks, gloo): per rank, what a Llama's training step holds
(parameters, buffers and AdamW's state) and allocates on top of it (gathered weights, activations, the loss, the
gradients) at tp 2 and tp 4 against FSDP alone over the 4 ranks, each with the same micro-batch per rank, next to
`llmtune plan`'s figures; then the chunked loss alone, the peak it allocates per rank on one micro-batch's tokens
with the lm_head split over 1, 2 and 4 ranks (loss parallel) and its hidden states over the sequence as sequence
parallelism leaves them.

    python -m benchmarks.tensor_parallel [--seq-len 1024] [--layers 4]

Measured as benchmarks/plan_accuracy.py measures (measure_parts: live storages before the step, the profiler's
highest total during it), the largest rank shown. One launch of 4 processes runs every case one after another.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.plan_accuracy import REPO, case_config, measure_parts, profiled_memory

RANKS = 4
VOCAB, HIDDEN = 32000, 256
# (name, recipe overrides)
CASES = [("FSDP over 4 ranks", []), ("tp 2 x dp 2", ["parallel.tp_size=2"]),
         ("tp 2 x dp 2, no sequence parallelism", ["parallel.tp_size=2", "parallel.sequence_parallel=false"]),
         ("tp 4", ["parallel.tp_size=4"])]
LOSS_TP = (1, 2, 4)


def write_model(folder: Path, layers: int, seq_len: int) -> None:
    """A Llama whose vocabulary (32,000) dominates its loss, as a real one's does."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=1024, num_hidden_layers=layers,
                num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=seq_len).save_pretrained(folder)


def loss_peak(tp: int, rows: int, seq_len: int, chunk: int) -> int:
    """Under torchrun: the peak bytes the chunked loss (forward, which computes its gradients, and backward)
    allocates on this rank for `rows` rows of `seq_len` tokens, the lm_head split over `tp` ranks (whole at 1) and
    the hidden states over the sequence as sequence parallelism leaves them (each rank's 1/tp of each row's tokens)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from llmtune.model.loss import LossOptions, cross_entropy_sum

    mesh = init_device_mesh("cpu", (RANKS // tp, tp), mesh_dim_names=("dp", "tp"))
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator) * 0.02
    hidden = torch.randn(rows, seq_len, HIDDEN, generator=generator)
    if tp > 1:
        weight = distribute_tensor(weight, mesh["tp"], [Shard(0)])
        hidden = distribute_tensor(hidden, mesh["tp"], [Shard(1)])
    weight, hidden = weight.requires_grad_(), hidden.requires_grad_()
    labels = torch.randint(0, VOCAB, (rows, seq_len), generator=generator)

    def step():
        cross_entropy_sum(hidden, weight, None, labels, LossOptions(chunk_size=chunk)).backward()

    step()
    first = profiled_memory(lambda: torch.empty(1))[0]
    earlier = first["Total Allocated"] - first["Bytes"]
    return max(m["Total Allocated"] for m in profiled_memory(step)) - earlier


def worker(model_dir: str, seq_len: int, out: str) -> None:
    """Every case, then the loss alone, on this rank; one record per case and rank in `out`."""
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    for number, (_, overrides) in enumerate(CASES):
        held, during = measure_parts(case_config(model_dir, seq_len, overrides, world), keep_process_group=True)
        with open(out, "a") as f:
            f.write(json.dumps({"case": number, "held": held, "during": during}) + "\n")
    config = case_config(model_dir, seq_len, [], world)
    for tp in LOSS_TP:
        peak = loss_peak(tp, config.train.per_device_train_batch_size, seq_len, config.train.chunk_loss_size)
        with open(out, "a") as f:
            f.write(json.dumps({"loss_tp": tp, "peak": peak}) + "\n")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        model_dir, seq_len, out = args.worker
        worker(model_dir, int(seq_len), out)
        return
    from llmtune.model.build import load_model_config
    from llmtune.run.plan import plan_memory

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, out = Path(tmp) / "model", Path(tmp) / "records.jsonl"
        write_model(model_dir, args.layers, args.seq_len)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}",
                   "-m", "benchmarks.tensor_parallel", "--worker", str(model_dir), str(args.seq_len), str(out)]
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        if result.returncode:
            raise SystemExit(result.stderr[-4000:])
        records = [json.loads(line) for line in out.read_text().splitlines()]
        print(f"Llama hidden {HIDDEN}, {args.layers} layers, vocab {VOCAB}, fp32, micro-batch 2 x {args.seq_len} "
              f"tokens per rank, chunked loss 512, {RANKS} CPU ranks; MiB per rank (the largest rank)")
        print("| layout | held: parameters + optimizer state | planned | step's allocations on top | "
              "planned peak - state |")
        print("|---|---:|---:|---:|---:|")
        for number, (name, overrides) in enumerate(CASES):
            mine = [r for r in records if r.get("case") == number]
            held, during = max(r["held"] for r in mine), max(r["during"] for r in mine)
            config = case_config(str(model_dir), args.seq_len, overrides, RANKS)
            plan = plan_memory(config, load_model_config(config.model), RANKS)
            state = plan.sharded_state(0)
            print(f"| {name} | {held / 2**20:.1f} | {state / 2**20:.1f} | {during / 2**20:.1f} | "
                  f"{(plan.peak - state) / 2**20:.1f} |")
        print("\nthe chunked loss alone (forward + backward), peak allocated per rank, MiB")
        print("| lm_head split over | peak | of tp 1's |")
        print("|---|---:|---:|")
        peaks = {tp: max(r["peak"] for r in records if r.get("loss_tp") == tp) for tp in LOSS_TP}
        for tp, peak in peaks.items():
            print(f"| {tp} rank(s) | {peak / 2**20:.1f} | {peak / peaks[1]:.2f} |")


if __name__ == "__main__":
    main()
