"""Context parallelism: per-rank memory and step time of a training step at growing sequence lengths,
cp=1 (one process) against cp=2 (two processes), on a small Llama; and the longest sequence each
fits under a memory cap.

    python benchmarks/context_parallel.py [--lengths 2048 4096 8192 16384] [--cap-gib 1.0] [--doc-len 0] [--cp 1 2]

Each (length, cp) case runs in fresh processes: one step to warm up (it also creates the optimizer
state), one timed step, one measured step. Memory is counted in tensors, as CUDA's
max_memory_allocated would count it, per rank (the largest rank is shown):
- activations: the bytes of every tensor autograd keeps for backward, after the forward;
- peak: the highest total of live tensor bytes during the step above what was live before it
  (activations, gradients, optimizer work and the transient buffers of attention and
  all-to-all), read from the profiler's memory events.
Peak RSS is not used: glibc keeps freed memory for reuse and its mmap threshold moves with what a
process happened to free before, which added about 0.2 GiB to either case and made cp=2/cp=1
read 0.65 when the tensors said 0.54.

--doc-len N packs documents of N tokens into each sequence (position_ids restart at each): attention must
keep them apart. A mask over the whole sequence would grow with its square; llmtune attends span by span on
every layout (llmtune/model/attention.py), so memory should grow linearly: for each length twice another, the
last lines give each cp's peak over twice its peak at half the length (1.0 is linear).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def step_case(model_dir: str, length: int, doc_len: int, out: str) -> None:
    """Under torchrun: three training steps on one sequence of `length` tokens; appends this rank's figures."""
    import torch

    from llmtune.config import (CheckpointConfig, Config, DataConfig, ModelConfig, MonitorConfig, ParallelConfig,
                                PeftConfig, TrainConfig)
    from llmtune.features.registry import enabled_features
    from llmtune.model.loss import shift_labels
    from llmtune.model.build import build_model, load_model_config
    from llmtune.run.parallel import ParallelState

    cp = int(os.environ["WORLD_SIZE"])
    config = Config(task="pt", model=ModelConfig(config=model_dir, tokenizer=model_dir), data=DataConfig(),
                    train=TrainConfig(), peft=PeftConfig(), parallel=ParallelConfig(cp_size=cp),
                    checkpoint=CheckpointConfig(), monitor=MonitorConfig())
    state = ParallelState.initialize(config.parallel)
    features = enabled_features(config)
    model = build_model(load_model_config(config.model), config.model, config.train, state, features)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "shift_labels": shift_labels(ids)}
    if doc_len:
        inputs["position_ids"] = (torch.arange(length) % doc_len)[None]
    inputs = features.transform(inputs)
    storages, activations = {}, []

    def keep(tensor):
        # Storages by address: one activation saved by two nodes counts once; the layers' gathered
        # parameters, also saved, are freed by FSDP after the forward and count zero.
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage()
        return tensor

    def step(record_saved: bool = False) -> None:
        with torch.autograd.graph.saved_tensors_hooks(keep if record_saved else (lambda t: t), lambda t: t):
            loss = model(**inputs)
        if record_saved:
            activations.append(sum(storage.nbytes() for storage in storages.values()))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    started = time.perf_counter()
    step()
    seconds = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as tmp:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            step(record_saved=True)
        prof.export_chrome_trace(f"{tmp}/trace.json")
        events = json.loads(Path(f"{tmp}/trace.json").read_text())["traceEvents"]
    peak = max((e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"), default=0)
    with open(out, "a") as f:
        f.write(json.dumps({"rank": state.rank, "activations_gib": activations[0] / 2**30, "peak_gib": peak / 2**30,
                            "seconds": seconds}) + "\n")
    state.close()


def run(model_dir: Path, length: int, cp: int, doc_len: int, tmp: Path) -> dict:
    out = tmp / f"case_{length}_{cp}.jsonl"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}",
                             __file__, "--case", str(model_dir), str(length), str(doc_len), str(out)], cwd=REPO,
                            capture_output=True, text=True)
    if result.returncode:
        return {"failed": result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"}
    ranks = [json.loads(line) for line in out.read_text().splitlines()]
    return {key: max(r[key] for r in ranks) for key in ("activations_gib", "peak_gib", "seconds")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--cap-gib", type=float, default=1.0)
    parser.add_argument("--doc-len", type=int, default=0, help="pack documents of this many tokens (0: one)")
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2], choices=[1, 2], help="cp sizes to run")
    parser.add_argument("--case", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        step_case(args.case[0], int(args.case[1]), int(args.case[2]), args.case[3])
        return
    from transformers import LlamaConfig

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=4, max_position_embeddings=max(args.lengths)).save_pretrained(model_dir)
        documents = f"documents of {args.doc_len} tokens" if args.doc_len else "one document"
        print(f"Llama hidden 256, 4 layers, 8 heads (4 kv), fp32, sdpa, batch 1, {documents}; GiB per rank; "
              f"cap {args.cap_gib} GiB")
        print(f"{'tokens':>7} | " + " | ".join(f"{f'cp={cp} act':>8} {'peak':>6} {'s':>6}" for cp in args.cp)
              + f" | {'cp2/cp1 act':>11} {'peak':>6}")
        fits, peaks = {cp: 0 for cp in args.cp}, {cp: {} for cp in args.cp}
        for length in args.lengths:
            results = {cp: run(model_dir, length, cp, args.doc_len, Path(tmp)) for cp in args.cp}
            for cp, result in results.items():
                if "failed" not in result:
                    peaks[cp][length] = result["peak_gib"]
                    if result["peak_gib"] <= args.cap_gib:
                        fits[cp] = length
            cells = [f"{'failed':>22}" if "failed" in r else
                     f"{r['activations_gib']:8.3f} {r['peak_gib']:6.3f} {r['seconds']:6.1f}" for r in results.values()]
            one, two = results.get(1, {"failed": ""}), results.get(2, {"failed": ""})
            ratios = f"{'':>18}" if "failed" in one or "failed" in two else \
                f"{two['activations_gib'] / one['activations_gib']:11.3f} {two['peak_gib'] / one['peak_gib']:6.3f}"
            print(f"{length:>7} | {' | '.join(cells)} | {ratios}")
        for cp, by_length in peaks.items():
            for length, peak in by_length.items():
                if length // 2 in by_length and length % 2 == 0:
                    print(f"cp={cp}: peak at {length} tokens / (2 x peak at {length // 2}) = "
                          f"{peak / (2 * by_length[length // 2]):.2f}")
        print(f"longest sequence whose peak fits {args.cap_gib} GiB per rank: "
              + ", ".join(f"cp={cp} {length}" for cp, length in fits.items()) + " tokens")


if __name__ == "__main__":
    main()
