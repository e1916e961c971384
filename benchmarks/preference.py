"""Preference training on CPU: llmtune dpo's speed against TRL's DPOTrainer on the same pairs, and the memory of dpo
against sft at the same tokens.

    pip install -e '.[bench]'    # TRL, for this benchmark only: llmtune never imports it
    python benchmarks/preference.py [--pairs 128] [--batch 8] [--steps 10] [--warmup 2] [--repeats 1] [--seq 1024]
                                    [--length-scale 1] [--contenders NAME ...] [--out results.json]

Workload. --pairs preference pairs in TRL's conversational form (a user prompt, an assistant's chosen and rejected
answers), seeded (preference_pairs): the words of every prompt and answer counted log-normal (median 24, sigma 0.7),
clipped to [8, 80] (times --length-scale), the chosen and the rejected answer drawn apart, so that lengths vary 10x
over the pairs and within one. The words are ones the demo's tokenizer (llmtune.demo.assets) holds whole, about one
token each; the tokenizer carries llmtune's basic chat template, through which both render the pairs: the same token
ids. The model is throughput.py's Llama of 19.5M parameters (4 layers, hidden 256, vocab 32,000), its seeded initial
weights saved once and loaded by every contender and every reference (TRL's, llmtune's `model` and the one that
precomputes). fp32, one process. Learning rate 1e-6 (TRL's default for DPO), beta 0.1, the sigmoid loss, clipping at
1.0, no weight decay, --warmup + --steps optimizer steps.

Speed. This machine is shared: another process's burst slowed single steps 15x, for seconds to minutes (torch's
threads wait on each other while one of them waits for a core). So llmtune and TRL take turns in one process, step by
step, and see the same machine, as throughput.py --interleaved does for the plain loop:
- TRL DPOTrainer: DPOConfig's defaults, its own collator (each batch of --batch pairs, chosen and rejected padded to
  the batch's longest sequence), gradient checkpointing, its reference a second copy of the model; bf16 off, for fp32
  as llmtune (TRL's default on CPU, autocast to bf16, is another computation). After each of its steps (a callback
  at on_step_end), one of llmtune dpo's.
- TRL, no checkpointing: the same with gradient_checkpointing false, the work llmtune does (it checkpoints nothing by
  default), in turn with llmtune dpo again.
- llmtune dpo there: its defaults (dpo.reference: model, a second sharded copy; each sequence's log-probabilities by
  the chunked loss path), --batch pairs per step, as TRL's (per_device_train_batch_size counts pairs), which the
  collator packs into one row, every pair whole. Its trainer is built after TRL's, so TRL's steps run under
  llmtune's setting of glibc's malloc (run/cpu_memory.py), which speeds them up if anything.
Each step is timed by throughput.py's StepClock (llmtune: one Trainer.advance, data included; TRL: from the end of
llmtune's step to its next on_step_end, data included), the first --warmup left out. Pairs/s: the mean pairs of a
timed step over the median step time. A step's time follows its tokens, about the same at every step (llmtune's
rows; TRL's batch of 8 padded pairs), not its pairs (llmtune's rows hold 4 to 12); the median is not moved by a
step another process slowed. The ratio is taken in each process, then its median over --repeats. Goal: llmtune dpo /
TRL DPOTrainer >= 2.

Memory (and the speed of each alone), each llmtune contender alone in fresh processes:
- llmtune sft: the pairs' sequences as sft samples (each pair's prompt + chosen and prompt + rejected, the same token
  ids), packed into as many rows of --seq tokens per step as llmtune dpo's --batch pairs fill on average (--batch x
  packed rows / pairs, at least 1): about the same tokens per step.
- llmtune dpo, as above.
- llmtune dpo precomputed: dpo.reference: precomputed (the reference's log-probabilities of every pair computed before
  training, in the same process, its model freed after).
Each process's peak RSS (ru_maxrss: every page it held, its libraries included), and its RSS once its libraries are
imported, before anything is built (Python, torch, transformers, datasets, llmtune: about 0.42 GiB); peak - baseline
is what the run adds: weights, gradients, optimizer state, activations, data, and for precomputed the
precomputation, which runs first in the same process. The goals (llmtune dpo / llmtune sft <= 2, llmtune dpo
precomputed / llmtune sft <= 1.2) are judged on peak - baseline, the memory that grows with the model and the tokens;
the peak RSS ratios, which the shared baseline pulls toward 1, are printed beside them. With llmtune's malloc setting
the RSS does not shrink below its peak: memory freed (the precomputing reference's) is kept for the next tensors.
"""
import argparse
import json
import math
import random
import statistics
import sys
import tempfile
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Run as a script, this folder comes first on sys.path, where benchmarks/peft.py would stand in for the peft package
# (which transformers imports); last, it still gives throughput and hf_trainer_baseline.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE] + [str(HERE)]

from throughput import (MODEL, RESULT, StepClock, Workload, contender_options, llmtune_step, run_contenders,  # noqa: E402
                        packed_rows, peak_rss_gib, time_steps, write_model)

LEARNING_RATE = 1e-6  # DPOConfig's default
BETA = 0.1  # DPOConfig's and llmtune's default
SEED = 42
# Words the demo's tokenizer holds whole: a text of n words is about n tokens.
WORDS = ("the", "garden", "market", "river", "library", "school", "kitchen", "station", "hill", "quiet", "asked",
         "answered", "said", "liked", "met", "keep", "track", "help", "sum", "plus", "what", "that", "them", "was",
         "were", "you", "day", "near", "and", "gives", "get", "Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Hana")
# Words of each prompt and answer: log-normal (median e^mu), clipped to [shortest, longest].
LENGTHS = dict(mu=math.log(24), sigma=0.7, shortest=8, longest=80)
PAIRS_FILE, SFT_FILE = "pairs.jsonl", "sft.jsonl"


@dataclass(frozen=True)
class Contender:
    """runner: "llmtune" (alone in its process: speed and memory) or "trl" (TRL's steps and llmtune dpo's taking
    turns in one process: speed); task: llmtune's (dpo or sft); unit: what its speed counts, "pairs" or "tokens";
    settings: what it changes from the common setup, recipe sections for llmtune, DPOConfig arguments for TRL."""
    runner: str
    task: str = "dpo"
    unit: str = "pairs"
    settings: dict = field(default_factory=dict)


LLMTUNE_DPO = "llmtune dpo"
CONTENDERS = {
    "TRL DPOTrainer": Contender("trl"),
    "TRL, no checkpointing": Contender("trl", settings={"gradient_checkpointing": False}),
    "llmtune sft": Contender("llmtune", task="sft", unit="tokens"),
    LLMTUNE_DPO: Contender("llmtune", settings={"dpo": {"reference": "model"}}),
    "llmtune dpo precomputed": Contender("llmtune", settings={"dpo": {"reference": "precomputed"}}),
}
SPEED_GOALS = {"TRL DPOTrainer": ">= 2"}  # of llmtune dpo / the TRL contender
# (numerator, denominator, goal) of the memory added by the run (peak - baseline).
MEMORY_RATIOS = [(LLMTUNE_DPO, "llmtune sft", "<= 2"), ("llmtune dpo precomputed", "llmtune sft", "<= 1.2")]
STEP_COUNTS = {"pairs": "samples", "tokens": "input_tokens"}  # llmtune's StepRecord field of each unit


def beside(trl: str) -> str:
    """The name of llmtune dpo's steps taken in turn with those of TRL contender `trl`."""
    return f"{LLMTUNE_DPO}, in turn with {trl}"


def preference_pairs(count: int, seed: int = 0, scale: float = 1.0) -> list[dict]:
    """`count` pairs in TRL's conversational form with explicit prompt, of LENGTHS' word counts times `scale`."""
    # The words drawn apart from the counts, so that a scale changes every count and nothing else.
    counts, words = random.Random(seed), random.Random(f"words {seed}")

    def text() -> str:
        drawn = counts.lognormvariate(LENGTHS["mu"], LENGTHS["sigma"])
        length = round(min(max(drawn, LENGTHS["shortest"]), LENGTHS["longest"]))
        return " ".join(words.choice(WORDS) for _ in range(max(1, round(length * scale))))

    return [{"prompt": [{"role": "user", "content": text()}],
             "chosen": [{"role": "assistant", "content": text()}],
             "rejected": [{"role": "assistant", "content": text()}]} for _ in range(count)]


def ranking_pairs(path: Path) -> list[dict]:
    """The pairs of a LLaMA-Factory ranking file in sharegpt form (dpo_en_demo.json: conversations, chosen, rejected)
    in TRL's conversational form, every turn before the answers the prompt: data the benchmark's words do not draw,
    real prompts and answers as long as users' are."""
    from llmtune.data.formats import SHAREGPT_TAGS, TAG_ROLES

    roles = {SHAREGPT_TAGS[tag]: role for tag, role in TAG_ROLES.items()}

    def turn(message: dict) -> dict:
        return {"role": roles[message["from"]], "content": message["value"]}

    return [{"prompt": [turn(m) for m in row["conversations"]], "chosen": [turn(row["chosen"])],
             "rejected": [turn(row["rejected"])]} for row in json.loads(path.read_text())]


def fitting_pairs(pairs: list[dict], tokenizer_path: Path, longest: int) -> list[dict]:
    """The pairs whose prompt + answer are at most `longest` tokens both (dpo.max_length): none is cut, by either
    side's truncation; the others are left out, and counted."""
    sequences = sequence_lengths(tokenizer_path, [pair["prompt"] + pair[answer] for pair in pairs
                                                  for answer in ("chosen", "rejected")])
    kept = [pair for pair, a, b in zip(pairs, sequences[0::2], sequences[1::2]) if max(a, b) <= longest]
    print(f"{len(kept)} of the file's {len(pairs)} pairs hold at most {longest} tokens (--seq / 2) in each sequence")
    return kept


def sft_samples(pairs: list[dict]) -> list[dict]:
    """The pairs' sequences as sft conversations: prompt + chosen, then prompt + rejected, of each pair."""
    return [{"messages": pair["prompt"] + pair[answer]} for pair in pairs for answer in ("chosen", "rejected")]


# --- in a worker process: build one contender, time its steps, read its memory


def rss_gib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**30


def contender_workload(contender: Contender, workload: Workload, root: Path, out: Path) -> Workload:
    """The workload as this contender reads it: its task's data, tokenized into a cache of its own run (each llmtune
    run pays its tokenization and, precomputed, its reference values)."""
    data = str(root / (SFT_FILE if contender.task == "sft" else PAIRS_FILE))
    # dpo's micro-batch counts pairs, TRL's --batch; sft's its packed rows, the workload's llmtune_batch.
    batch = workload.llmtune_batch if contender.task == "sft" else workload.batch
    return replace(workload, task=contender.task, data=data, llmtune_batch=batch,
                   llmtune_data={**workload.llmtune_data, "train_files": [data], "cache_dir": str(out / "cache")})


def llmtune_runner(contender: Contender, workload: Workload, root: Path, out: Path, state):
    """One step of an llmtune contender per call (throughput.llmtune_step), started from the saved weights (its
    reference too), not from model.config's initialisation."""
    settings = {**contender.settings, "model": {"name_or_path": workload.model, "config": None}}
    if contender.task == "dpo":
        settings["dpo"] = {"beta": BETA, **settings["dpo"]}
    return llmtune_step(contender_workload(contender, workload, root, out), settings, state, out,
                        STEP_COUNTS[contender.unit])


def taking_turns(trl_clock: StepClock, batch_pairs: deque, llmtune_clock: StepClock, llmtune_step):
    """A TRL callback that laps TRL's steps as hf_trainer_baseline.StepTimer does and after each runs one of llmtune's
    steps, on a clock of its own and out of TRL's: TRL's lap runs from the end of llmtune's step to TRL's next
    on_step_end, its data included."""
    from hf_trainer_baseline import StepTimer

    class TakingTurns(StepTimer):
        def on_step_end(self, args, state, control, **kwargs):
            super().on_step_end(args, state, control, **kwargs)
            llmtune_clock.start()
            llmtune_clock.lap(*llmtune_step())
            trl_clock.start()

    return TakingTurns(trl_clock, batch_pairs)


def run_trl(name: str, workload: Workload, root: Path, out: Path) -> dict:
    """warmup + steps optimizer steps of TRL's DPOTrainer, its own collator wrapped to count each batch's pairs, and
    as many of llmtune dpo's, taking turns: {runner: StepClock result}."""
    import datasets
    import torch
    from hf_trainer_baseline import SEED as HF_SEED
    from hf_trainer_baseline import counting
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from llmtune.run.parallel import ParallelState

    model = AutoModelForCausalLM.from_pretrained(workload.model, dtype=torch.float32)
    with open(workload.data) as f:
        pairs = datasets.Dataset.from_list([json.loads(line) for line in f])
    args = DPOConfig(output_dir=str(out / "trl"), use_cpu=True, seed=HF_SEED,
                     max_steps=workload.warmup + workload.steps, per_device_train_batch_size=workload.batch,
                     learning_rate=workload.learning_rate, beta=BETA, bf16=False, save_strategy="no",
                     logging_strategy="no", report_to="none", disable_tqdm=True, **CONTENDERS[name].settings)
    trainer = DPOTrainer(model=model, args=args, train_dataset=pairs,
                         processing_class=AutoTokenizer.from_pretrained(workload.tokenizer))
    batch_pairs = deque()
    trainer.data_collator = counting(trainer.data_collator, batch_pairs, size=lambda row: 1)
    # llmtune's process group and trainer once TRL's accelerator has decided it trains in one CPU process.
    state = ParallelState.initialize()
    (out / "llmtune").mkdir()
    step = llmtune_runner(CONTENDERS[LLMTUNE_DPO], workload, root, out / "llmtune", state)
    clocks = {name: StepClock(workload.warmup), beside(name): StepClock(workload.warmup)}
    trainer.add_callback(taking_turns(clocks[name], batch_pairs, clocks[beside(name)], step))
    trainer.train()
    state.close()
    return {runner: clock.result() for runner, clock in clocks.items()}


def run_llmtune(name: str, workload: Workload, root: Path, out: Path) -> dict:
    """warmup + steps steps of an llmtune contender alone: {name: StepClock result}."""
    from llmtune.run.parallel import ParallelState

    state = ParallelState.initialize()
    result = time_steps({name: llmtune_runner(CONTENDERS[name], workload, root, out, state)}, workload)
    state.close()
    return result


def worker(name: str, root: Path) -> None:
    """One contender in this process: its runners' step times; alone, its RSS once its libraries are imported (the
    baseline its memory is counted from)."""
    workload, out = Workload.read(root), Path(tempfile.mkdtemp(dir=root, prefix="run-"))
    if CONTENDERS[name].runner == "trl":
        results = run_trl(name, workload, root, out)
    else:
        from llmtune.run.worker import build_trainer  # noqa: F401 (torch, transformers, datasets, llmtune)

        baseline = rss_gib()
        results = run_llmtune(name, workload, root, out)
        results[name]["baseline_rss_gib"] = baseline
    print(RESULT + json.dumps({"runners": results, "peak_rss_gib": peak_rss_gib()}), flush=True)


# --- in the parent: the data, the model, the runs, the table


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def write_tokenizer(root: Path, source: Path | None = None) -> Path:
    """The demo's tokenizer, or the tokenizer folder `source`, with llmtune's basic chat template, which TRL reads from
    the tokenizer. A real tokenizer's own template is not kept: Mistral-7B-Instruct-v0.2's (the one real tokenizer of
    at most 32,000 tokens) refuses system turns, which dpo_en_demo has, and runs '[/INST]' into an answer's first
    token, which llmtune refuses as a prompt it cannot tell from its answer."""
    from transformers import AutoTokenizer

    from llmtune.data.templates import BUILTIN_TEMPLATES
    from llmtune.demo.assets import write_demo_assets

    if source is None:
        write_demo_assets(root / "assets")
        source = root / "assets" / "tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    if len(tokenizer) > MODEL["vocab_size"]:
        raise SystemExit(f"--tokenizer {source}: {len(tokenizer)} tokens; the benchmark's model has "
                         f"{MODEL['vocab_size']} (Mistral-7B-Instruct-v0.2's tokenizer fits)")
    tokenizer.chat_template = BUILTIN_TEMPLATES["basic"]
    tokenizer.save_pretrained(str(root / "tokenizer"))
    return root / "tokenizer"


def special_ids(tokenizer_path: Path) -> tuple:
    """(bos, eos, pad) of the tokenizer, for the model's config."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    return tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id


def write_weights(folder: Path) -> None:
    """Seeded initial weights beside write_model's config: what every contender and every reference loads."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(SEED)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder))).save_pretrained(str(folder))


def sequence_lengths(tokenizer_path: Path, conversations: list[list[dict]]) -> list[int]:
    """Tokens of each whole conversation as llmtune renders it (the same ids as TRL's)."""
    from transformers import AutoTokenizer

    from llmtune.data.templates import render, text_ids

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    return [len(text_ids(tokenizer, render(tokenizer, messages, False))) for messages in conversations]


def spread(values) -> str:
    return f"median {statistics.median(values):.0f}, {min(values)}-{max(values)}"


def prepare(root: Path, args) -> tuple[Workload, dict]:
    """Write the tokenizer, the model, the pairs and the sft samples under root; print what will be measured; the
    workload and the setup, for the JSON."""
    import numpy as np

    tokenizer = write_tokenizer(root, args.tokenizer)
    params = write_model(root / "model", args.seq, args.tokenizer and special_ids(tokenizer))
    write_weights(root / "model")
    if args.pairs_file:
        pairs = fitting_pairs(ranking_pairs(args.pairs_file), tokenizer, args.seq // 2)[:args.pairs]
    else:
        pairs = preference_pairs(args.pairs, scale=args.length_scale)
    write_jsonl(root / PAIRS_FILE, pairs)
    samples = sft_samples(pairs)
    write_jsonl(root / SFT_FILE, samples)
    lengths = np.array(sequence_lengths(tokenizer, [s["messages"] for s in samples]))
    prompts = sequence_lengths(tokenizer, [p["prompt"] for p in pairs])
    pair_tokens = lengths[0::2] + lengths[1::2]
    dpo_rows, sft_rows = packed_rows(pair_tokens, args.seq), packed_rows(lengths, args.seq)
    rows = max(1, round(args.batch * dpo_rows / len(pairs)))
    if lengths.max() > args.seq // 2:
        raise SystemExit(f"--seq {args.seq}: a sequence of {lengths.max()} tokens would be cut by dpo.max_length "
                         f"(--seq / 2); raise --seq")
    shared = (pair_tokens - np.array(prompts)).sum() / pair_tokens.sum()
    setup = {"params": params, "pairs": len(pairs), "pairs_per_step": args.batch, "llmtune_sft_rows_per_step": rows,
             "row_tokens": args.seq, "pair_tokens_mean": float(pair_tokens.mean()), "steps": args.steps,
             "warmup": args.warmup, "repeats": args.repeats, "learning_rate": LEARNING_RATE, "beta": BETA}
    print(f"Llama {params / 1e6:.1f}M parameters ({MODEL['num_hidden_layers']} layers, hidden {MODEL['hidden_size']}, "
          f"vocab {MODEL['vocab_size']}), fp32, one process; {args.steps} steps timed after {args.warmup}, "
          f"{args.repeats} repeat(s)")
    print(f"{len(pairs)} pairs; tokens: prompt {spread(prompts)}; prompt + answer {spread(lengths.tolist())}; "
          f"pair (both sequences) mean {pair_tokens.mean():.0f}, {spread(pair_tokens.tolist())}")
    print(f"with the prompt once: {shared:.0%} of those tokens (llmtune since issue 65)")
    print(f"TRL and llmtune dpo: {args.batch} pairs per step (llmtune's packed into one row); llmtune sft: {rows} "
          f"row(s) of {args.seq} tokens per step ({sft_rows} rows hold the samples, "
          f"{lengths.sum() / sft_rows / args.seq:.0%} full), about as many tokens")
    workload = Workload(task="dpo", model=str(root / "model"), tokenizer=str(tokenizer), data=str(root / PAIRS_FILE),
                        seq=args.seq, batch=args.batch, llmtune_batch=rows,
                        llmtune_data={"max_seq_len": args.seq}, steps=args.steps, warmup=args.warmup,
                        learning_rate=LEARNING_RATE)
    return workload, setup


def speed(result: dict) -> float:
    """Pairs (or tokens) per second of one run's timed steps: the mean of a step over the median step time (above)."""
    return statistics.mean(result["step_tokens"]) / statistics.median(result["step_times_s"])


def speed_table(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per TRL contender: its pairs/s and those of llmtune dpo's steps in turn with it, and their ratio, in each
    repeat (the same process: the same drift of the machine) and the medians."""
    table = {}
    for name in (n for n in CONTENDERS if CONTENDERS[n].runner == "trl" and n in runs):
        trl, llmtune = [speed(r) for r in runs[name]], [speed(r) for r in runs[beside(name)]]
        each = [a / b for a, b in zip(llmtune, trl)]
        table[name] = {"trl_pairs_per_s": statistics.median(trl), "llmtune_pairs_per_s": statistics.median(llmtune),
                       "ratio": statistics.median(each), "each_repeat": each, "goal": SPEED_GOALS.get(name, "")}
    return table


def alone_table(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per llmtune contender alone in its processes: speed (median over repeats), step size, memory (the largest
    over repeats)."""
    table = {}
    for name in (n for n in CONTENDERS if CONTENDERS[n].runner == "llmtune" and n in runs):
        results = runs[name]
        table[name] = {"unit": CONTENDERS[name].unit, "speed": statistics.median(speed(r) for r in results),
                       "per_step": statistics.median(n for r in results for n in r["step_tokens"]),
                       "peak_rss_gib": max(r["peak_rss_gib"] for r in results),
                       "baseline_rss_gib": statistics.median(r["baseline_rss_gib"] for r in results),
                       "added_gib": max(r["peak_rss_gib"] - r["baseline_rss_gib"] for r in results),
                       "each_repeat": [speed(r) for r in results]}
    return table


def memory_ratios(alone: dict[str, dict]) -> list[dict]:
    return [{"ratio": f"{a} / {b}", "added": alone[a]["added_gib"] / alone[b]["added_gib"],
             "peak": alone[a]["peak_rss_gib"] / alone[b]["peak_rss_gib"], "goal": goal}
            for a, b, goal in MEMORY_RATIOS if a in alone and b in alone]


def print_tables(speeds: dict[str, dict], alone: dict[str, dict], memory: list[dict]) -> None:
    if speeds:
        width = max(map(len, speeds)) + 2
        print(f"\nSpeed, {LLMTUNE_DPO}'s steps and TRL's taking turns in one process:\n{'':{width}}"
              f"{'TRL pairs/s':>11}  {'llmtune dpo pairs/s':>19}  {'llmtune / TRL':>13}  each repeat")
        for name, row in speeds.items():
            print(f"{name:{width}}{row['trl_pairs_per_s']:>11.2f}  {row['llmtune_pairs_per_s']:>19.2f}  "
                  f"{row['ratio']:>12.2f}x  " + " ".join(f"{r:.2f}" for r in row["each_repeat"])
                  + (f"  (goal {row['goal']})" if row["goal"] else ""))
    if alone:
        width = max(map(len, alone)) + 2
        print(f"\nAlone in a process, speed and memory:\n{'':{width}}{'speed':>17}  {'per step':>8}  "
              f"{'peak RSS':>9}  {'baseline':>9}  {'peak - baseline':>15}  each repeat")
        for name, row in alone.items():
            print(f"{name:{width}}{row['speed']:>9,.2f} {row['unit'] + '/s':<7}  {row['per_step']:>8,.0f}  "
                  f"{row['peak_rss_gib']:>5.2f} GiB  {row['baseline_rss_gib']:>5.2f} GiB  "
                  f"{row['added_gib']:>11.2f} GiB  " + " ".join(f"{s:,.2f}" for s in row["each_repeat"]))
        for ratio in memory:
            print(f"{ratio['ratio']}: peak - baseline {ratio['added']:.3f}x (goal {ratio['goal']}), peak RSS "
                  f"{ratio['peak']:.3f}x")


def pair_options(parser: argparse.ArgumentParser, section: str) -> None:
    """The workload's options of a benchmark on preference pairs (this one, rm.py): `section`, the task's recipe
    section, whose max_length is half a row."""
    parser.add_argument("--pairs", type=int, default=128, help="Preference pairs written (one epoch of data).")
    parser.add_argument("--batch", type=int, default=8, help="Pairs per optimizer step (TRL's; llmtune's about).")
    parser.add_argument("--seq", type=int, default=1024,
                        help=f"llmtune's tokens per packed row (data.max_seq_len; {section}.max_length is half).")
    parser.add_argument("--length-scale", type=float, default=1.0,
                        help="Factor on every prompt's and answer's word count.")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pair_options(parser, "dpo")
    parser.add_argument("--pairs-file", type=Path,
                        help="A LLaMA-Factory ranking file in sharegpt form (dpo_en_demo.json): its first --pairs "
                             "pairs that fit --seq / 2, instead of drawn ones; needs --tokenizer.")
    parser.add_argument("--tokenizer", type=Path,
                        help="A tokenizer folder of at most 32,000 tokens (Mistral-7B-Instruct-v0.2's) instead of the "
                             "demo's, with llmtune's basic chat template.")
    contender_options(parser, CONTENDERS)
    args = parser.parse_args()
    if args.pairs_file and not args.tokenizer:
        parser.error("--pairs-file needs --tokenizer: the demo's tokenizer holds the benchmark's words, not real text")
    return args


def main() -> None:
    args = parse_args()
    run_contenders(args, worker, prepare, any(CONTENDERS[name].runner == "trl" for name in args.contenders), report,
                   __file__)


def report(runs: dict[str, list[dict]]) -> dict:
    speeds, alone = speed_table(runs), alone_table(runs)
    memory = memory_ratios(alone)
    print_tables(speeds, alone, memory)
    return {"speed": speeds, "alone": alone, "memory_ratios": memory}


if __name__ == "__main__":
    main()
