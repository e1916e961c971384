"""Memory per rank and step time of a small mixture-of-experts model under llmtune, plain FSDP2 against expert
parallelism, in the same run.

    python -m benchmarks.moe_memory [--nproc 2 4] [--seq 512] [--batch 2] [--steps 3] [--warmup 1] [--json PATH]

The model is a Qwen3-MoE of 0.21B parameters, nearly all of them experts (hidden 512, 8 layers of 64 experts of
intermediate 256, 8 per token, the demo's byte vocabulary of 256, untied), with random weights written by
save_pretrained, so that its experts are stored one by one as on the Hub. It trains as `llmtune pt` does
(benchmarks/peft.py's worker: llmtune's own trainer, pt on the demo corpus, SEQ x BATCH tokens per rank, AdamW,
the router loss, activation checkpointing, fp32, no checkpoint), WARMUP + STEPS steps, in a torchrun launch (gloo,
CPU) of its own per case: for each process count of --nproc, plain FSDP2 (ep 1) and every
parallel.expert_parallel N > 1 that divides it. One process is a case too (--nproc 1 2): FSDP2 then shards nothing,
and its process has every core (torchrun gives each of several processes one thread).

Per case, the largest rank's figures:
- params: the bytes of the parameters the rank holds between steps (its FSDP2 shards); experts: those of the
  experts alone. Expert parallelism changes neither: each rank holds 1/processes of every layer's experts either
  way (E/N whole experts, sharded further over processes/N ranks, instead of a slice of all E).
- gathered: the experts' parameters of one layer as they are while that layer's experts run (FSDP2 has gathered
  them): every expert of the layer under plain FSDP2, the rank's E/N under expert parallelism. FSDP2 may hold the
  next layer's gathered beside it (its prefetch).
- load RSS, step RSS: the process's peak RSS once the model is loaded and at the end of training, minus its peak
  before the build (Python, torch, transformers and the process group): what the run itself added. On CPU llmtune
  keeps the memory tensors free in the heap (llmtune/run/cpu_memory.py), so this is the heap's high-water mark,
  which blocks of many sizes (plain FSDP2's gathered layers, unsharded gradients and their flat copies) fragment:
  more than the tensors alive at once, and varying by some hundreds of MiB from run to run.
- step time: the mean over the STEPS steps after the WARMUP ones (metrics.jsonl's step_time_s, rank 0's: data,
  forward and backward, optimizer). On CPU cores that other jobs share it moved by up to 2x between runs, and the
  ratios with it: run it twice (--json keeps each step's time).
- all-to-all: metrics.jsonl's expert_all_to_all_mib, the MiB of token states a rank sent to other ranks' experts and
  back in a step's forwards (the mean over ranks and steps; its backward sends as much again); plain FSDP2 sends
  no tokens, and all-gathers the experts' weights instead.
Then each expert-parallel case against plain FSDP2 on as many processes.
"""

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from benchmarks.peft import local_bytes, measure, write_model_and_data
from benchmarks.peft import worker as train_worker

SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256, intermediate_size=1024,
             tie_word_embeddings=False, router_aux_loss_coef=0.001)
# (title, key in a case's figures, divisor, format): the table's columns after the case's name.
COLUMNS = (("params MiB", "parameter_bytes", 2**20, ",.1f"), ("experts MiB", "expert_bytes", 2**20, ",.1f"),
           ("gathered MiB", "gathered_expert_bytes", 2**20, ",.1f"), ("load RSS MiB", "load_rss_bytes", 2**20, ",.1f"),
           ("step RSS MiB", "step_rss_bytes", 2**20, ",.1f"), ("step time s", "step_time_s", 1, ".3f"),
           ("all-to-all MiB", "all_to_all_mib", 1, ",.1f"))
RATIOS = ("gathered_expert_bytes", "load_rss_bytes", "step_rss_bytes", "step_time_s")


def qwen3_moe(vocab_size: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=vocab_size, **SHAPE))


def expert_probe(trainer) -> dict:
    """The experts' figures of this rank (the worker's probe): the bytes it holds of them, and the most that one
    experts module's parameters take while the module runs, filled in by a hook as the trainer trains. The hook
    runs after FSDP2's, which has gathered the parameters by then."""
    from llmtune.model.expert_parallel import experts_modules

    modules = experts_modules(trainer.model.hf_model)
    figures = {"expert_bytes": sum(local_bytes(p) for module in modules for p in module.parameters()),
               "gathered_expert_bytes": 0}

    def gathered(module, _args):
        held = sum(local_bytes(p) for p in module.parameters())
        figures["gathered_expert_bytes"] = max(figures["gathered_expert_bytes"], held)

    for module in modules:
        module.register_forward_pre_hook(gathered)
    return figures


def cases(process_counts: list[int]) -> list[tuple[int, int]]:
    """(processes, expert_parallel) for each process count: plain FSDP2 (1), then each degree > 1 that divides the
    processes and the experts."""
    return [(n, ep) for n in process_counts for ep in range(1, n + 1) if n % ep == 0 and SHAPE["num_experts"] % ep == 0]


def case_figures(result: dict) -> dict:
    """A case's figures: the largest rank's of each held and peak memory, and the step time and all-to-all volume
    over the timed steps."""
    ranks = result["ranks"]
    largest = {key: max(rank[key] for rank in ranks)
               for key in ("parameter_bytes", "expert_bytes", "gathered_expert_bytes")}
    volumes = [r["expert_all_to_all_mib"] for r in result["records"] if "expert_all_to_all_mib" in r]
    return {**largest,
            "load_rss_bytes": max(r["load_rss_bytes"] - r["baseline_rss_bytes"] for r in ranks),
            "step_rss_bytes": max(r["peak_rss_bytes"] - r["baseline_rss_bytes"] for r in ranks),
            "step_time_s": statistics.mean(r["step_time_s"] for r in result["records"]),
            "step_times_s": [r["step_time_s"] for r in result["records"]],  # for the --json, to judge the noise
            "all_to_all_mib": statistics.mean(volumes) if volumes else None,
            "total_params": result["total_params"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[2], help="process counts, one launch per case each")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps, after --warmup")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write each case's figures here")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        train_worker(args.worker[0], Path(args.worker[1]), expert_probe)
        return
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_model_and_data(root, args, qwen3_moe)
        for n, ep in cases(args.nproc):
            # No checkpoint: the peaks are the steps'.
            sections = {"parallel": {"expert_parallel": ep}, "checkpoint": {"save_steps": 0, "export_hf": False}}
            figures[n, ep] = case_figures(measure(root, f"moe_{n}_ep{ep}", args, sections, n, "benchmarks.moe_memory"))
    print(f"Qwen3-MoE {next(iter(figures.values()))['total_params'] / 1e9:.2f}B parameters "
          f"({', '.join(f'{k} {v}' for k, v in SHAPE.items())}), fp32; pt seq {args.seq} x batch {args.batch} per "
          f"rank; step time: mean of {args.steps} steps after {args.warmup}; per rank: the largest rank's\n")
    print(f"| {'processes, layout':<20} | " + " | ".join(f"{title:>14}" for title, *_ in COLUMNS) + " |")
    print(f"|{'-' * 22}|" + "|".join(f"{'-' * 15}:" for _ in COLUMNS) + "|")
    for (n, ep), row in figures.items():
        name = f"{n}, " + (f"ep {ep}" if ep > 1 else "plain FSDP2")
        print(f"| {name:<20} | " + " | ".join("-".rjust(14) if row[key] is None else f"{row[key] / divisor:>14{form}}"
                                              for _, key, divisor, form in COLUMNS) + " |")
    titles = {key: title.rsplit(" ", 1)[0] for title, key, *_ in COLUMNS}  # without the unit
    split = [(n, ep) for n, ep in figures if ep > 1]
    print("\nexpert parallelism / plain FSDP2 on as many processes:" if split else "")
    for n, ep in split:
        row, plain = figures[n, ep], figures[n, 1]
        print(f"  {n}, ep {ep}: " + ", ".join(f"{titles[key]} {row[key] / plain[key]:.2f}" for key in RATIOS))
    if args.json:
        args.json.write_text(json.dumps([{"processes": n, "expert_parallel": ep, **row}
                                         for (n, ep), row in figures.items()], indent=1))


if __name__ == "__main__":
    main()
