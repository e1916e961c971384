"""Loading a 1.1B-parameter model from safetensors: llmtune's build_model on 1 and 2 ranks against transformers'
AutoModelForCausalLM.from_pretrained in one process, in the same run: wall time and peak RSS of every process.

    python benchmarks/load.py [--dir DIR] [--dtype fp32|bf16] [--repeats 3] [--json PATH]

The model is a Llama of TinyLlama's shape (hidden 2048, 22 layers, intermediate 5632, 32 heads, 4 key/value
heads, vocabulary 32000, untied: 1.10B parameters) with random weights, written by the benchmark into DIR (kept)
or a temporary folder. The file is fp32 by default because both loaders hold fp32 weights (llmtune's master
weights; from_pretrained is asked for dtype=float32): what is read is what is kept, and the memory of a load can
be set against one number, the model's fp32 size. --dtype bf16 writes the file as the Hub's checkpoints are,
and both loaders then cast while they read.

Each case runs in fresh processes, HF's in a plain one, llmtune's under torchrun (gloo, CPU) as `--nproc N`
starts them; the cases take turns, --repeats times, and the medians are shown. Per process:
- time: from just before the load (llmtune: after a barrier of all ranks) until the weights are in memory;
  llmtune's includes reading the config, the meta-device build, fully_shard and materialising the shard.
  HF's is shown twice: when from_pretrained returns, and once every weight has been read. Weights whose dtype
  is the file's come back as pages of the file mapped into memory, read at first use: the first figure
  leaves that reading (and its memory) to the first training step;
- peak RSS: getrusage's ru_maxrss at the end, the process's lifetime peak; baseline: the same just before the
  load (Python, torch, transformers, and for llmtune the process group), and peak minus baseline: the load's own.
The file was just written, so it is read from the page cache: the times are of reading memory, not a disk.
"""

import argparse
import json
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
             num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False)
HF_CASE = "HF from_pretrained"
HF_READ_CASE = "HF, every weight read"
FIGURES = ("seconds", "peak_gib", "baseline_gib")


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def record(out: str, case: str, rank: int, seconds: float, baseline_gib: float) -> None:
    with open(out, "a") as f:
        f.write(json.dumps({"case": case, "rank": rank, "seconds": seconds, "peak_gib": peak_rss_gib(),
                            "baseline_gib": baseline_gib}) + "\n")


def hf_case(folder: str, out: str) -> None:
    """One process: transformers' own load of the folder, in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    baseline = peak_rss_gib()
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    record(out, HF_CASE, 0, time.perf_counter() - started, baseline)
    # Weights of the file's own dtype come back as pages of the file mapped into memory, read only when first
    # used: reading each one makes it resident, as the first training step would.
    with torch.no_grad():
        for param in model.parameters():
            param.sum()
    record(out, HF_READ_CASE, 0, time.perf_counter() - started, baseline)


def llmtune_case(folder: str, out: str) -> None:
    """Under torchrun: the model as `llmtune sft` builds it from model.name_or_path, each rank reading its rows."""
    from llmtune.config import ModelConfig, TrainConfig
    from llmtune.features.base import Features
    from llmtune.model.build import build_model, load_model_config
    from llmtune.run.parallel import ParallelState

    state = ParallelState.initialize()
    model_cfg = ModelConfig(name_or_path=folder)
    baseline = peak_rss_gib()
    state.barrier()
    started = time.perf_counter()
    build_model(load_model_config(model_cfg), model_cfg, TrainConfig(), state, Features([]))
    record(out, llmtune_name(state.world_size), state.rank, time.perf_counter() - started, baseline)
    state.close()


def llmtune_name(ranks: int) -> str:
    return f"llmtune, {ranks} rank{'s' if ranks > 1 else ''}"


def write_model(folder: Path, dtype: str) -> tuple[int, int]:
    """A random Llama of SHAPE saved as safetensors; (parameters, bytes on disk)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    params = sum(p.numel() for p in model.parameters())
    model.to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]).save_pretrained(folder)
    return params, sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def case_commands(folder: Path, out: Path) -> dict[str, list[str]]:
    own = [__file__, "--case"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return {HF_CASE: [sys.executable, *own, "hf", str(folder), str(out)],
            **{llmtune_name(n): [*torchrun, f"--nproc-per-node={n}", *own, "llmtune", str(folder), str(out)]
               for n in (1, 2)}}


def measure(folder: Path, repeats: int, out: Path) -> dict[tuple[str, int], dict]:
    """(case, rank) -> median seconds, peak and baseline GiB over the repeats, the cases taking turns."""
    commands = case_commands(folder, out)
    # The llmtune of this checkout, whichever one is installed.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for _ in range(repeats):
        for command in commands.values():
            result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
            if result.returncode:
                sys.exit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    runs: dict[tuple[str, int], list[dict]] = {}
    for line in out.read_text().splitlines():
        result = json.loads(line)
        runs.setdefault((result["case"], result["rank"]), []).append(result)
    order = sorted(runs, key=lambda key: (key[0] != HF_CASE, key[0], key[1]))
    return {key: {name: statistics.median(r[name] for r in runs[key]) for name in FIGURES} for key in order}


def label(case: str, rank: int) -> str:
    return case if case.startswith("HF") else f"{case}, rank {rank}"


def report(results: dict[tuple[str, int], dict]) -> None:
    print(f"{'process':<30} {'time s':>7} {'peak RSS GiB':>12} {'baseline':>8} {'above baseline':>14}")
    for (case, rank), r in results.items():
        print(f"{label(case, rank):<30} {r['seconds']:7.2f} {r['peak_gib']:12.2f} {r['baseline_gib']:8.2f} "
              f"{r['peak_gib'] - r['baseline_gib']:14.2f}")
    for reference in (HF_CASE, HF_READ_CASE):
        hf = results[(reference, 0)]
        print(f"\n{'ours / ' + reference:<30} {'time':>7} {'peak RSS':>12} {'':>8} {'above baseline':>14}")
        for (case, rank), r in results.items():
            if not case.startswith("HF"):
                above = (r["peak_gib"] - r["baseline_gib"]) / (hf["peak_gib"] - hf["baseline_gib"])
                print(f"{label(case, rank):<30} {r['seconds'] / hf['seconds']:7.2f} "
                      f"{r['peak_gib'] / hf['peak_gib']:12.2f} {'':>8} {above:14.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, help="write the model here and keep it (default: a temporary folder)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="dtype of the safetensors file")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--case", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        {"hf": hf_case, "llmtune": llmtune_case}[args.case[0]](*args.case[1:])
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.dir or Path(tmp) / "model"
        # Written by a child process: a process started from this one inherits its peak RSS as its own
        # ru_maxrss, so this one must never hold the model.
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            params, size = pool.submit(write_model, folder, args.dtype).result()
        print(f"Llama {params / 1e9:.2f}B parameters ({', '.join(f'{k} {v}' for k, v in SHAPE.items())}); "
              f"{args.dtype} safetensors: {size / 2**30:.2f} GiB, fp32 in memory: {params * 4 / 2**30:.2f} GiB; "
              f"medians of {args.repeats} runs\n")
        results = measure(folder, args.repeats, Path(tmp) / "results.jsonl")
    report(results)
    if args.json:
        args.json.write_text(json.dumps([{"case": case, "rank": rank, **r} for (case, rank), r in results.items()],
                                        indent=1))


if __name__ == "__main__":
    main()
