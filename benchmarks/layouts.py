"""The layouts for a model that outgrows plain FSDP, side by side in one run: plain FSDP, HSDP, CPU offload and QLoRA,
the same pretrained model, data and steps.

    python -m benchmarks.layouts [--nproc 4] [--hidden 1024] [--layers 12] [--steps N]

Each layout trains in a torchrun launch of its own (benchmarks/peft.py's worker: pt on the demo corpus, activation
checkpointing on), one after the other, so that each process's peak is its layout's. Per layout, the largest rank's:
the model state it holds (parameters as stored, and AdamW's moments), its peak memory (on CUDA the allocator's
max_memory_allocated, the device's; on CPU the process's peak RSS, where every layout's state lives in the same
memory, so that offload can save nothing there) and the median step time; then each against plain FSDP in the same
run. HSDP needs 4 processes to shard within groups of 2 (on 2 it replicates whole copies, as DDP does).
"""

import argparse
import sys
import tempfile
from pathlib import Path

from benchmarks.peft import measure, mib, write_model_and_data

LAYOUTS = {"plain FSDP": {},
           "HSDP (dp_replicate 2)": {"parallel": {"dp_replicate": 2}},
           "CPU offload": {"parallel": {"cpu_offload": True}},
           "QLoRA (nf4 base, LoRA r 16)": {"peft": {"method": "qlora", "r": 16, "alpha": 32.0}}}


def largest(result: dict, key: str):
    values = [rank[key] for rank in result["ranks"]]
    return None if None in values else max(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, help="default: 4 x hidden")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=6, help="timed steps, after --warmup")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_model_and_data(root, args)
        results = {name: measure(root, f"layout_{number}", args, sections, args.nproc)
                   for number, (name, sections) in enumerate(LAYOUTS.items())}
    device = "device" if largest(results["plain FSDP"], "device_peak_bytes") is not None else "RSS"
    print(f"Llama hidden {args.hidden}, intermediate {args.intermediate or 4 * args.hidden}, {args.layers} layers, "
          f"{results['plain FSDP']['total_params'] / 1e6:.0f}M parameters, fp32; pt seq {args.seq} x batch "
          f"{args.batch} per rank, {args.nproc} processes; step time: median of {args.steps} steps after "
          f"{args.warmup}; per rank: the largest rank's")
    print(f"| {'layout':<28} | {'parameters':>11} | {'AdamW state':>11} | {'peak ' + device:>11} | "
          f"{'step time':>9} | {'peak / plain':>12} | {'time / plain':>12} |")
    print(f"|{'-' * 30}|{'-' * 12}:|{'-' * 12}:|{'-' * 12}:|{'-' * 10}:|{'-' * 13}:|{'-' * 13}:|")
    key = "device_peak_bytes" if device == "device" else "peak_rss_bytes"
    plain = results["plain FSDP"]
    for name, result in results.items():
        print(f"| {name:<28} | {mib(largest(result, 'parameter_bytes')):>11} | "
              f"{mib(largest(result, 'optimizer_bytes')):>11} | {mib(largest(result, key)):>11} | "
              f"{result['step_time_s']:8.3f}s | {largest(result, key) / largest(plain, key):12.2f} | "
              f"{result['step_time_s'] / plain['step_time_s']:12.2f} |", flush=True)


if __name__ == "__main__":
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    main()
