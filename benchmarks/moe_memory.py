"""Memory per rank of a small mixture-of-experts model under llmtune: 1 rank against 2 ranks, in the same run.

    python benchmarks/moe_memory.py [--dir DIR] [--seq 512] [--json PATH]

The model is a Qwen3-MoE of 0.24B parameters, 0.2B of them experts (hidden 512, 8 layers, 64 experts of
intermediate 256, 8 per token, vocabulary 32000, untied), with random weights written by save_pretrained into DIR
(kept) or a temporary folder, so that its experts are stored one by one as on the Hub. Each case runs under torchrun (gloo, CPU) in fresh
processes: the model is built as `llmtune pt` builds it (meta device, fully_shard per decoder layer, each rank
reading and converting only the experts of its shard), then trains one AdamW step on a batch of 2 x SEQ tokens
with the router loss on. Per rank:
- held: the bytes of the rank's own shards of the parameters (all, and the experts alone) and the gradients and
  AdamW states of the same size (4 x fp32 parameters in all);
- peak RSS: getrusage's ru_maxrss after the load and after the step, minus the baseline just before the load
  (Python, torch, transformers and the process group).
The ratios divide the 2-rank figures by the 1-rank ones: 0.5 is the ideal for what FSDP2 shards; activations
of the step and the all-gathered layer are not sharded.
"""

import argparse
import json
import multiprocessing
import resource
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256, intermediate_size=1024,
             vocab_size=32000, tie_word_embeddings=False, router_aux_loss_coef=0.001)
FIGURES = ("params_gib", "experts_gib", "state_gib", "load_gib", "step_gib")


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def case(folder: str, seq: int, out: str) -> None:
    """Under torchrun: build, load, one training step; one JSON line per rank."""
    import torch

    from llmtune.config import (CheckpointConfig, Config, DataConfig, ModelConfig, MonitorConfig, ParallelConfig,
                                PeftConfig, TrainConfig)
    from llmtune.features.registry import enabled_features
    from llmtune.model.build import build_model, load_model_config
    from llmtune.model.state import local_rows
    from llmtune.run.parallel import ParallelState

    state = ParallelState.initialize()
    config = Config(task="pt", model=ModelConfig(name_or_path=folder), data=DataConfig(), train=TrainConfig(),
                    parallel=ParallelConfig(), peft=PeftConfig(), checkpoint=CheckpointConfig(),
                    monitor=MonitorConfig())
    features = enabled_features(config)  # the router loss is one
    baseline = peak_rss_gib()
    started = time.perf_counter()
    model = build_model(load_model_config(config.model), config.model, config.train, state, features)
    load_seconds, load_gib = time.perf_counter() - started, peak_rss_gib()
    params = {name: local_rows(p) for name, p in model.named_parameters()}
    bytes_of = lambda names: sum(params[n].numel() * params[n].element_size() for n in names)  # noqa: E731
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, seq + 1), generator=generator)
    inputs = features.transform({"input_ids": ids[:, :-1], "shift_labels": ids[:, 1:]})
    model(**inputs).backward()
    optimizer.step()
    result = {"rank": state.rank, "world": state.world_size, "load_seconds": load_seconds,
              "params_gib": bytes_of(params) / 2**30,
              "experts_gib": bytes_of([n for n in params if ".experts." in n]) / 2**30,
              "state_gib": 4 * bytes_of(params) / 2**30,
              "load_gib": load_gib - baseline, "step_gib": peak_rss_gib() - baseline}
    with open(out, "a") as f:
        f.write(json.dumps(result) + "\n")
    state.close()


def write_model(folder: Path) -> int:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPE))
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, help="write the model here and keep it (default: a temporary folder)")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--case", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        case(args.case[0], int(args.case[1]), args.case[2])
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.dir or Path(tmp) / "model"
        # Written by a child process, so that the cases (started from this one) do not inherit its peak RSS.
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            params = pool.submit(write_model, folder).result()
        out = Path(tmp) / "results.jsonl"
        for ranks in (1, 2):
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                       __file__, "--case", str(folder), str(args.seq), str(out)]
            result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
            if result.returncode:
                sys.exit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
        results = [json.loads(line) for line in out.read_text().splitlines()]
    print(f"Qwen3-MoE {params / 1e9:.2f}B parameters ({', '.join(f'{k} {v}' for k, v in SHAPE.items())}); "
          f"one step on 2 x {args.seq} tokens\n")
    print(f"{'ranks, rank':<12} {'params GiB':>10} {'experts':>8} {'+grads+Adam':>11} {'load RSS':>9} "
          f"{'step RSS':>9}   (GiB; RSS above the baseline)")
    widths = (10, 8, 11, 9, 9)
    for r in sorted(results, key=lambda r: (r["world"], r["rank"])):
        print(f"{r['world']}, {r['rank']:<9} " + " ".join(f"{r[k]:>{w}.3f}" for k, w in zip(FIGURES, widths)))
    one = next(r for r in results if r["world"] == 1)
    for r in sorted((r for r in results if r["world"] == 2), key=lambda r: r["rank"]):
        print(f"2 / 1, rank {r['rank']} " + " ".join(f"{r[k] / one[k]:>{w}.2f}" for k, w in zip(FIGURES, widths)))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
