"""Generation from the run's sharded model: llmtune's engine (llmtune/generation/engine.py) on the FSDP2 training
module against transformers' own `generate` of the same weights, in completions per second; and FSDP2's all-gathers
during a generation, which the engine makes once per sharded unit for the whole phase, never per token.

    python benchmarks/generation.py [--prompts 64] [--batch_size 32] [--max_new_tokens 32] [--repeats 5]
                                    [--warmup 1] [--nproc 1|2 ...] [--threads N] [--do_sample]
                                    [--groups G] [--prompt_lengths 16 96]
                                    [--gather_tokens 8 32] [--quick] [--out results.json]

Model and prompts. A Llama of hidden 256, 4 layers, MLP 688, 8 heads (no GQA), the demo's tokenizer and vocabulary
of 256 (llmtune.demo.assets; the demo's own config scaled up), tied embeddings, fp32, its weights the seeded
initialisation llmtune's worker gives it (train.seed 0; nothing is trained): 3.2M parameters. --prompts prompts cut
from the demo's pre-training corpus, their lengths drawn uniform in --prompt_lengths (default [16, 96]) tokens
(seeded), each with --groups completions (num_return_sequences; 1 by default, 8 for GRPO's groups: the engine
prefills a prompt once for its group, transformers once per completion). Every completion runs
exactly --max_new_tokens tokens: the EOS id handed to both sides is the vocabulary's size, an id no logit stands for
(the engine's eos_ids=[256], transformers' eos_token_id=[256]), so that both stop at the same length and do the same
work, the same stopping check included.

Each case is one torchrun launch (gloo on CPU, nccl on CUDA) of this script's worker mode, which builds the model
as a run does (llmtune.config.load_config of a pt recipe, ParallelState, check_inputs, run.worker.build_trainer:
trainer.model is the sharded CausalLMForTraining; nothing trained) and then:
- 1 process: exports it (checkpoint.hf_export.export_trained, fp32) and loads the folder with transformers'
  AutoModelForCausalLM.from_pretrained, fp32, on the same device. The engine (generation.engine.generate on
  trainer.model, greedy unless --do_sample) and transformers' generate on the HF model take turns, each first in
  every other round, --warmup untimed rounds then --repeats timed ones, each a whole pass over the prompts. The HF
  side is given the batches the engine makes (prompts sorted by length, --batch_size completions per batch, whole
  groups, left-padded; each prompt's row repeated for its samples, as TRL does), the same max_new_tokens and
  sampling keys, and turns its output into lists of token ids as the engine does. Each side's completions/s is the
  completions over its median time; the ratio engine / HF is taken in each round and its median reported (goal:
  >= 1; >= 1.5 with --groups 8 on 200-token prompts), beside the ratio of the median CPU seconds of a pass
  (time.process_time), which a machine shared with other processes moves less. With greedy decoding the two must
  choose the same tokens: the share of completions that agree is printed.
- 2 processes: the engine alone, each rank generating every 2nd prompt (one batch of --prompts / 2 where
  --batch_size allows), all ranks learning every completion (ParallelState.all_gather_object); timed on rank 0 from
  a barrier to the engine's return.
- All-gathers: FSDP2's foreach_all_gather (the name torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py calls,
  patched there), counted over one engine call at each of --gather_tokens' two max_new_tokens. Goal: the same
  count at both, one per sharded unit (the root and each decoder layer), none per generated token. On 1 process
  FSDP2 skips the all-gather altogether (FSDPParamGroup.unshard returns before it where its group has one rank): 0.

Threads. torchrun gives each of 2 processes one thread (OMP_NUM_THREADS=1); one process keeps torch's default (the
cores), unless --threads sets them everywhere; the threads are printed. On a machine of 2 cores shared with other
processes, 2 threads in one process waited on each other (OpenMP's spinning): a pass took 20-35x as long as on one
thread, on both sides alike, the ratio swinging 0.3x-2.8x from round to round. Measure there with --threads 1.

Times are wall clock (time.perf_counter; on CUDA after a synchronize). Nothing here is asserted:
tests/unit/test_generation_benchmark.py runs --quick (tiny sizes) to keep the script working.
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# Run as a script, this folder comes first on sys.path, where benchmarks/peft.py would stand in for the peft package
# (which transformers imports).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

SHAPE = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=8)
QUICK_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4)
PROMPT_LENGTHS = (16, 96)  # tokens, uniform, inclusive
QUICK = dict(prompts=8, batch_size=4, max_new_tokens=4, repeats=1, warmup=0, gather_tokens=[2, 6])
QUICK_PROMPT_LENGTHS = (4, 12)
CORPUS_DOCS = 400  # of the demo's pt.jsonl, for the prompts; the run's own data file holds 64 of them
RESULT = "generation result: "  # marks the worker's line among what the libraries print
ONE_RANK_NOTE = "1 process: FSDP2 skips the all-gather (a group of one rank), 0 whatever the length"


# --- in a worker process (under torchrun)


@contextmanager
def counting_all_gathers():
    """Counts FSDP2's all-gathers while the block runs: {"all_gathers": n}, filled in as they happen."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    count = {"all_gathers": 0}
    original = _fsdp_param_group.foreach_all_gather

    def counted(*args, **kwargs):
        count["all_gathers"] += 1
        return original(*args, **kwargs)

    _fsdp_param_group.foreach_all_gather = counted
    try:
        yield count
    finally:
        _fsdp_param_group.foreach_all_gather = original


def sharded_units(model) -> int:
    """FSDP2's parameter groups in the module: what one all-gather each unshards."""
    from torch.distributed.fsdp import FSDPModule

    return sum(len(sub._get_fsdp_state()._fsdp_param_groups) for sub in model.modules() if isinstance(sub, FSDPModule))


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_generate(model, prompts: list[list[int]], sampling, never: int, pad_id: int, batch_size: int,
                device) -> list[list[int]]:
    """transformers' generate of `model` over the prompts in the engine's batches (sorted by length, whole groups
    of num_return_sequences, left-padded), each prompt's row repeated for its samples as TRL's GRPOTrainer repeats
    them (transformers' greedy decoding refuses num_return_sequences > 1): each completion's new token ids, in
    prompt then sample order."""
    import torch

    samples = sampling.num_return_sequences
    order = sorted(range(len(prompts)), key=lambda p: len(prompts[p]))
    out: list[list[list[int]] | None] = [None] * len(prompts)
    per_batch = max(1, batch_size // samples)
    for start in range(0, len(order), per_batch):
        batch = order[start:start + per_batch]
        length = max(len(prompts[p]) for p in batch)
        input_ids = torch.tensor([[pad_id] * (length - len(prompts[p])) + prompts[p] for p in batch
                                  for _ in range(samples)], device=device)
        attention_mask = torch.tensor([[0] * (length - len(prompts[p])) + [1] * len(prompts[p]) for p in batch
                                       for _ in range(samples)], device=device)
        keys = dict(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p) \
            if sampling.do_sample else {}
        made = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=sampling.do_sample,
                              num_beams=1, max_new_tokens=sampling.max_new_tokens, eos_token_id=[never],
                              pad_token_id=pad_id, **keys)
        rows = made[:, length:].tolist()
        for i, p in enumerate(batch):
            out[p] = rows[i * samples:(i + 1) * samples]
    return [ids for group in out for ids in group]


def timed(call, device, barrier=None) -> tuple[float, float, object]:
    """(wall seconds, this process's CPU seconds, what `call` returned)."""
    if barrier:
        barrier()
    sync(device)
    started, cpu = time.perf_counter(), time.process_time()
    result = call()
    sync(device)
    return time.perf_counter() - started, time.process_time() - cpu, result


def worker(root: Path) -> None:
    """One case in this torchrun launch: the settings from root/settings.json; rank 0 prints the result line."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmtune.checkpoint.hf_export import export_trained
    from llmtune.config import load_config
    from llmtune.generation.engine import Sampling, generate
    from llmtune.run.inputs import check_inputs
    from llmtune.run.parallel import ParallelState
    from llmtune.run.worker import build_trainer

    settings = json.loads((root / "settings.json").read_text())
    prompts = json.loads((root / "prompts.json").read_text())
    if settings["threads"]:
        torch.set_num_threads(settings["threads"])
    state = ParallelState.initialize()
    world = state.world_size
    out = root / f"run-{world}"
    recipe = {
        "model": {"config": str(root / "model"), "tokenizer": str(root / "assets" / "tokenizer")},
        "data": {"train_files": [str(root / "pt.jsonl")], "max_seq_len": 128, "cache_dir": str(out / "cache")},
        "train": {"output_dir": str(out), "max_steps": 1, "per_device_train_batch_size": 1, "seed": 0},
        "checkpoint": {"export_dtype": "fp32"},
        "monitor": {"plots": False},
    }
    try:
        config = load_config(recipe, [], "pt", world_size=world)
        check_inputs(config)
        trainer, tokenizer = build_trainer(config, state)
        model, device, pad_id = trainer.model, state.device, tokenizer.pad_token_id
        never = model.hf_model.config.vocab_size  # an id no logit stands for: every completion runs its full length
        sampling = Sampling(max_new_tokens=settings["max_new_tokens"], do_sample=settings["do_sample"],
                            num_return_sequences=settings["groups"])

        def engine(sampling=sampling):
            return generate(model, prompts, sampling, eos_ids=[never], pad_id=pad_id, device=device, seed=0,
                            step=0, batch_size=settings["batch_size"], state=state)

        result = {"world": world, "threads": torch.get_num_threads(), "device": str(device),
                  "groups": settings["groups"],
                  "sharded_units": sharded_units(model)}
        hf = None
        if world == 1:
            export_trained(model, tokenizer, out / "export", config.checkpoint, state, trainer.features)
            hf = AutoModelForCausalLM.from_pretrained(out / "export" / "hf", dtype=torch.float32).to(device).eval()
            result["attention"] = {"engine": model.attention, "hf": hf.config._attn_implementation}

            def baseline():
                return hf_generate(hf, prompts, sampling, never, pad_id, settings["batch_size"], device)

        # The two sides take turns, each first in every other round: both see the same drift of the machine.
        sides = {"engine": lambda: timed(engine, device, state.barrier)}
        if hf is not None:
            sides["hf"] = lambda: timed(baseline, device)
        times = {side: [] for side in sides}
        cpu_times = {side: [] for side in sides}
        made = {}
        for round_ in range(settings["warmup"] + settings["repeats"]):
            for side in (list(sides) if round_ % 2 == 0 else list(sides)[::-1]):
                seconds, cpu, made[side] = sides[side]()
                if round_ >= settings["warmup"]:
                    times[side].append(seconds)
                    cpu_times[side].append(cpu)
        engine_made, hf_made = made["engine"], made.get("hf")
        result["engine_seconds"], result["engine_cpu_seconds"] = times["engine"], cpu_times["engine"]
        assert all(len(c.ids) == sampling.max_new_tokens for c in engine_made), "a completion stopped early"
        result["completions"] = len(engine_made)
        result["tokens_per_completion"] = sampling.max_new_tokens
        if hf is not None:
            result["hf_seconds"], result["hf_cpu_seconds"] = times["hf"], cpu_times["hf"]
            assert all(len(ids) == sampling.max_new_tokens for ids in hf_made), "an HF completion stopped early"
            if not sampling.do_sample:  # sampled, each side draws from generators of its own
                result["same_tokens"] = sum(c.ids == ids for c, ids in zip(engine_made, hf_made)) / len(hf_made)

        gathers = {}
        for tokens in settings["gather_tokens"]:
            with counting_all_gathers() as count:
                engine(Sampling(max_new_tokens=tokens, do_sample=settings["do_sample"],
                                num_return_sequences=settings["groups"]))
            gathers[str(tokens)] = {"all_gathers": count["all_gathers"], "tokens_this_rank":
                                    len(range(state.rank, len(prompts), world)) * settings["groups"] * tokens}
        result["gathers"] = gathers
        if state.is_main:
            print(RESULT + json.dumps(result), flush=True)
    finally:
        state.close()


# --- in the parent: the assets, the prompts, the launches, the table


def prepare(root: Path, shape: dict, prompts: int, lengths: tuple[int, int]) -> dict:
    """The demo's assets, the model config of `shape`, a small pt data file and the prompts under root: the
    setup's figures."""
    from transformers import AutoConfig, AutoTokenizer

    from llmtune.demo.assets import write_demo_assets

    write_demo_assets(root / "assets")
    config = AutoConfig.from_pretrained(root / "assets" / "model")
    for key, value in shape.items():
        setattr(config, key, value)
    config.head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    config.save_pretrained(root / "model")
    docs = (root / "assets" / "data" / "pt.jsonl").read_text().splitlines()
    (root / "pt.jsonl").write_text("".join(line + "\n" for line in docs[:64]))
    tokenizer = AutoTokenizer.from_pretrained(root / "assets" / "tokenizer")
    stream = [i for line in docs[:CORPUS_DOCS] for i in tokenizer(json.loads(line)["text"],
                                                                  add_special_tokens=False)["input_ids"]]
    rng, cut, made = random.Random(0), 0, []
    for _ in range(prompts):
        length = rng.randint(*lengths)
        if cut + length > len(stream):
            cut = 0
        made.append([tokenizer.bos_token_id] + stream[cut:cut + length - 1])
        cut += length
    (root / "prompts.json").write_text(json.dumps(made))
    params = (config.vocab_size * config.hidden_size + config.num_hidden_layers * (
        2 * config.hidden_size * config.hidden_size
        + 2 * config.hidden_size * config.num_key_value_heads * config.head_dim
        + 3 * config.hidden_size * config.intermediate_size + 2 * config.hidden_size) + config.hidden_size)
    return {"shape": {**shape, "vocab_size": config.vocab_size, "tie_word_embeddings": config.tie_word_embeddings},
            "params": params, "prompts": prompts, "prompt_tokens": [len(p) for p in made]}


def launch(root: Path, nproc: int) -> dict:
    """This script's worker under torchrun on `nproc` processes: rank 0's result."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               __file__, "--worker", str(root)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode or not lines:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len(RESULT):])


def figures(results: dict[int, dict], completions: int) -> dict:
    """The figures of each case: completions/s (prompts over the median time), the ratios, the all-gathers."""
    out = {}
    if 1 in results:
        r = results[1]
        engine, hf = statistics.median(r["engine_seconds"]), statistics.median(r["hf_seconds"])
        out["one_process"] = {
            "engine_completions_per_s": completions / engine, "hf_completions_per_s": completions / hf,
            "engine_over_hf": statistics.median(h / e for e, h in zip(r["engine_seconds"], r["hf_seconds"])),
            "engine_over_hf_each_round": [h / e for e, h in zip(r["engine_seconds"], r["hf_seconds"])],
            "engine_cpu_s": statistics.median(r["engine_cpu_seconds"]),
            "hf_cpu_s": statistics.median(r["hf_cpu_seconds"]),
            "engine_over_hf_cpu": statistics.median(r["hf_cpu_seconds"]) / statistics.median(r["engine_cpu_seconds"]),
            "same_tokens": r.get("same_tokens"), "threads": r["threads"], "attention": r["attention"],
            "goal": ">= 1.5" if r["groups"] > 1 else ">= 1"}
    if 2 in results:
        r = results[2]
        out["two_processes"] = {"engine_completions_per_s": completions / statistics.median(r["engine_seconds"]),
                                "engine_cpu_s_rank0": statistics.median(r["engine_cpu_seconds"]),
                                "threads_per_process": r["threads"]}
        if 1 in results:
            out["two_processes"]["over_one_process_engine"] = (out["two_processes"]["engine_completions_per_s"]
                                                               / out["one_process"]["engine_completions_per_s"])
            out["two_processes"]["over_one_process_hf"] = (out["two_processes"]["engine_completions_per_s"]
                                                           / out["one_process"]["hf_completions_per_s"])
    out["all_gathers"] = {}
    for world, r in results.items():
        per = {tokens: {**g, "per_generated_token": g["all_gathers"] / g["tokens_this_rank"]}
               for tokens, g in r["gathers"].items()}
        counts = {g["all_gathers"] for g in per.values()}
        out["all_gathers"][str(world)] = {"sharded_units": r["sharded_units"], "by_max_new_tokens": per,
                                          "independent_of_length": len(counts) == 1,
                                          **({"note": ONE_RANK_NOTE} if world == 1 else {})}
    return out


def print_table(setup: dict, results: dict[int, dict], figs: dict) -> None:
    shape = setup["shape"]
    print(f"Llama {setup['params'] / 1e6:.2f}M parameters (hidden {shape['hidden_size']}, {shape['num_hidden_layers']}"
          f" layers, MLP {shape['intermediate_size']}, {shape['num_attention_heads']} heads, vocab "
          f"{shape['vocab_size']}), fp32, on {next(iter(results.values()))['device']}; {setup['prompts']} prompts of "
          f"{min(setup['prompt_tokens'])}-{max(setup['prompt_tokens'])} tokens, {setup['groups']} completion(s) each, "
          f"batch {setup['batch_size']}, "
          f"{setup['max_new_tokens']} new tokens each ({'sampling' if setup['do_sample'] else 'greedy'}; EOS never "
          f"drawn), {setup['repeats']} timed round(s) after {setup['warmup']}")
    if "one_process" in figs:
        f = figs["one_process"]
        print(f"\n1 process ({f['threads']} thread{'s' if f['threads'] > 1 else ''})  completions/s  CPU s per pass")
        print(f"  transformers generate   {f['hf_completions_per_s']:>12.2f}  {f['hf_cpu_s']:>14.3f}")
        print(f"  llmtune engine (FSDP2)  {f['engine_completions_per_s']:>12.2f}  {f['engine_cpu_s']:>14.3f}")
        print(f"  engine / HF             {f['engine_over_hf']:>11.3f}x  {f['engine_over_hf_cpu']:>13.3f}x  (goal "
              f"{f['goal']}; wall, each round: " + " ".join(f"{x:.3f}" for x in f["engine_over_hf_each_round"]) + ")")
        if f["same_tokens"] is not None:
            print(f"  same tokens as HF: {f['same_tokens']:.0%} of the completions")
    if "two_processes" in figs:
        f = figs["two_processes"]
        print(f"\n2 processes ({f['threads_per_process']} thread(s) each), each generating half the prompts")
        print(f"  llmtune engine (FSDP2)  {f['engine_completions_per_s']:>12.2f} completions/s"
              + (f"  ({f['over_one_process_engine']:.2f}x the engine on 1 process, "
                 f"{f['over_one_process_hf']:.2f}x HF on 1 process)" if "over_one_process_engine" in f else ""))
    print("\nFSDP2 all-gathers during one engine call (per rank)")
    for world, g in figs["all_gathers"].items():
        for tokens, row in g["by_max_new_tokens"].items():
            processes = f"{world} process{'es' if world != '1' else ''}"
            print(f"  {processes}, max_new_tokens {tokens:>3}: {row['all_gathers']:>3} all-gathers over "
                  f"{row['tokens_this_rank']} generated tokens ({row['per_generated_token']:.4f} per token); "
                  f"sharded units: {g['sharded_units']}")
        if "note" in g:
            print(f"  ({g['note']})")
        else:
            print(f"  the same at both lengths: {'yes' if g['independent_of_length'] else 'NO'} (goal: one per "
                  f"sharded unit, none per token)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64, help="Prompts per pass (each --groups completions).")
    parser.add_argument("--groups", type=int, default=1,
                        help="Completions of each prompt (num_return_sequences): the engine prefills a prompt once "
                             "for them.")
    parser.add_argument("--prompt_lengths", type=int, nargs=2, default=list(PROMPT_LENGTHS), metavar=("LO", "HI"),
                        help="The prompts' lengths in tokens, drawn uniform in [LO, HI].")
    parser.add_argument("--batch_size", type=int, default=32, help="Completions decoded together (both sides).")
    parser.add_argument("--max_new_tokens", type=int, default=32,
                        help="Tokens of every completion (no EOS is ever drawn: each runs its full length).")
    parser.add_argument("--repeats", type=int, default=5, help="Timed passes over the prompts, of each side.")
    parser.add_argument("--warmup", type=int, default=1, help="Untimed passes before them.")
    parser.add_argument("--nproc", type=int, choices=(1, 2), nargs="+", default=[1, 2],
                        help="The cases: 1 (engine against transformers, one process), 2 (the engine on 2 "
                             "processes); default both.")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch.set_num_threads in every process (default 0: left as the process has them; "
                             "torchrun gives each of 2 processes 1).")
    parser.add_argument("--do_sample", action="store_true",
                        help="Sample (transformers' defaults: temperature 1, top_k 50) rather than greedy decoding.")
    parser.add_argument("--gather_tokens", type=int, nargs=2, default=[8, 32], metavar=("SHORT", "LONG"),
                        help="The two max_new_tokens at which the all-gathers are counted.")
    parser.add_argument("--quick", action="store_true",
                        help="Tiny sizes (a model of hidden 64, 2 layers; 8 prompts of 4-12 tokens, 4 new tokens, "
                             "batch 4, one round, all-gathers at 2 and 6 tokens) to check the script runs.")
    parser.add_argument("--out", type=Path, help="Write the setup, the figures and every time here as JSON.")
    parser.add_argument("--worker", type=Path, metavar="ROOT", help=argparse.SUPPRESS)  # under torchrun
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.worker:
        worker(args.worker)
        return
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        setup = prepare(root, QUICK_SHAPE if args.quick else SHAPE, args.prompts,
                        QUICK_PROMPT_LENGTHS if args.quick else tuple(args.prompt_lengths))
        settings = {key: getattr(args, key) for key in ("batch_size", "max_new_tokens", "repeats", "warmup",
                                                         "do_sample", "gather_tokens", "threads", "groups")}
        (root / "settings.json").write_text(json.dumps(settings))
        setup.update(settings)
        results = {nproc: launch(root, nproc) for nproc in sorted(set(args.nproc))}
    figs = figures(results, args.prompts * args.groups)
    print_table(setup, results, figs)
    if args.out:
        args.out.write_text(json.dumps({"setup": setup, "figures": figs,
                                        "runs": {str(k): v for k, v in results.items()}}, indent=1))


if __name__ == "__main__":
    main()
