"""CPU training speed of llmtune against a plain hand-written FSDP2 loop and the HF Trainer, on the same model,
tokens, optimizer and steps.

    python benchmarks/throughput.py [--steps 30] [--warmup 5] [--repeats 2] [--seq 512] [--batch 8] [--nproc 1]
    python benchmarks/throughput.py --sft [--samples 2000] [--sft-seq 2048] [--batch 8] [--steps 30] ...
    python benchmarks/throughput.py --interleaved [--nproc 1|2] [--steps 30] [--warmup 5] [--seq 512] [--batch 8]
    python benchmarks/throughput.py --workers [--sft] [--steps 30] ...
    python benchmarks/throughput.py --ema [--sft] [--steps 30] ...

The model is a Llama of 19.5M parameters trained from scratch (4 layers, hidden 256, MLP 688, 4 heads of 64, vocab
32,000, untied lm_head); the demo's tokenizer (llmtune.demo.assets) gives the token ids. AdamW at lr 1e-3 without
weight decay, clipping at 1.0, everywhere: fused in llmtune and the HF Trainer (the default of both), foreach in the
plain loop.

- pt (default): the demo's pre-training corpus in blocks of --seq tokens, --batch blocks per step, for llmtune fp32
  (its defaults: packed documents kept apart, chunked loss), llmtune bf16 (train.bf16: FSDP2 mixed precision),
  llmtune fp32 + train.compile, the plain FSDP2 loop (plain_fsdp_loop.py: full logits, attention across
  documents, foreach AdamW) and the HF Trainer in fp32 and in its bf16 (hf_trainer_baseline.py). llmtune reads the
  corpus through its own pt pipeline, the others through plain_fsdp_loop.blocks: the same documents, the same
  tokens per step. Prints each contender's tokens/s and the ratios the goals are judged on: llmtune fp32 / HF fp32,
  llmtune bf16 / HF bf16, llmtune compile / llmtune fp32, llmtune fp32 / plain loop. With --nproc 2, llmtune and
  the plain loop run on 2 processes and the HF Trainer (one process on CPU) is left out.
- --sft: --samples pre-tokenized samples (data.format tokenized; the same ids for every contender) of
  instruction-like lengths: log-normal with mu = ln 200 (median 200 tokens) and sigma 0.9, rounded and clipped to
  [24, 1024]; a prompt of 20-60% of each sample carries label -100. One process. llmtune's defaults (packing into
  rows of --sft-seq tokens, document masks on), llmtune's packing without document masks, and the HF Trainer's
  defaults (random order, each batch of --batch samples padded to its longest). llmtune's rows per step are
  chosen for about the real tokens of the HF Trainer's step: --batch x (packed rows / samples), the rows counted
  by packing the lengths as llmtune does, at least 1. Speed is non-pad tokens per second. Prints the three and
  the ratios masked / unmasked packing and llmtune defaults / HF Trainer.
- --interleaved: the measurement an earlier issue judged on. llmtune's loop and the plain loop in the same
  processes, one step each in turn, alternating which goes first, for llmtune's defaults and for the same work
  as the plain loop (no document masks, full logits). Steps taken in turn see the same drift of the machine,
  which separate processes do not; prints each loop's tokens/s and llmtune / plain loop.
- --workers: data loading. llmtune alone on the pt workload (with --sft, the sft one), its defaults (the
  micro-batches collated in the training process) against 2 DataLoader workers (data.num_workers 2, kept
  between epochs: data.persistent_workers); prints both and their ratio. Mind that on a machine of few cores
  the workers take CPU from the training threads.
- --ema: the cost of a moving average of the weights. llmtune alone as with --workers, without and with
  train.ema_decay 0.9999 (one fp32 lerp over every trained parameter's local rows per step); prints both and
  their ratio (goal: at least 0.98, a step-time overhead of 2% at most).

Method. This machine's speed drifts by about 10% within seconds (a fixed matmul loop, same process). Every
contender runs in fresh processes of its own, all contenders once per repeat, the order rotated by one at each
repeat (--repeats times); a contender's tokens/s is the median over its repeats. One StepClock times every step
the same way, the first --warmup steps left out: the wall time of one whole turn of the loop, data included
(llmtune: one Trainer.advance; plain loop: one call; HF Trainer: from one on_step_end to the next, see
hf_trainer_baseline.py). For llmtune it also keeps the trainer's wait for each step's micro-batches; the
"data wait" column is their sum over the timed steps' time (metrics.jsonl's data_wait_frac, over the timed
steps), the median over repeats. In one run, tokens/s is the step's tokens over the median step time where every
step has the same tokens (pt), else the tokens of the timed steps over their time (sft). Also printed: each
repeat's tokens/s, the median real tokens per step and rank 0's peak RSS (of the whole process: under
--interleaved both loops share it).
"""

import argparse
import importlib.util
import json
import math
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
LEARNING_RATE = 1e-3  # plain_fsdp_loop.py's
# 19.5M parameters, 16.4M of them in the embeddings and the untied lm_head (a small model with a large vocabulary).
MODEL = dict(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4, tie_word_embeddings=False)
# Sample lengths of --sft: log-normal (mu, sigma; median e^mu = 200 tokens), clipped to [shortest, longest].
SFT_LENGTHS = dict(mu=math.log(200), sigma=0.9, shortest=24, longest=1024)
PROMPT_SHARE = (0.2, 0.6)  # range of each sft sample's share that is prompt (label -100)
RESULT = "throughput result: "  # marks the worker's line among what the libraries print


@dataclass(frozen=True)
class Contender:
    """parts: what runs in the contender's processes, "llmtune", "plain" or "hf"; several parts take turns, step by
    step. settings: what it changes from the common setup, recipe sections for llmtune, TrainingArguments for
    the HF Trainer."""
    parts: tuple[str, ...]
    settings: dict = field(default_factory=dict)


PT = {"llmtune fp32": Contender(("llmtune",)),
      "llmtune bf16": Contender(("llmtune",), {"train": {"bf16": True}}),
      "llmtune compile": Contender(("llmtune",), {"train": {"compile": True}}),
      "plain loop": Contender(("plain",)),
      "HF Trainer fp32": Contender(("hf",)),
      "HF Trainer bf16": Contender(("hf",), {"bf16": True})}
SFT = {"llmtune defaults": Contender(("llmtune",)),
       "llmtune unmasked": Contender(("llmtune",), {"data": {"document_mask": False}}),
       "HF Trainer": Contender(("hf",))}
# The plain loop attends across documents and computes the full logits; "same work" has llmtune do that too.
INTERLEAVED = {"same work": Contender(("plain", "llmtune"), {"data": {"document_mask": False},
                                                             "train": {"chunk_loss_size": 0}}),
               "defaults": Contender(("plain", "llmtune"))}
# llmtune alone, its defaults against one setting changed (--workers, --ema): the setting, its name in the table and
# the goal of the ratio; compared with the llmtune contender of the workload (pt or sft).
VARIANTS = {"workers": ({"data": {"num_workers": 2, "persistent_workers": True}}, "2 workers", ""),
            "ema": ({"train": {"ema_decay": 0.9999}}, "EMA 0.9999", ">= 0.98")}
BASES = {"pt": ("llmtune fp32", PT), "sft": ("llmtune defaults", SFT)}


def variant_contenders(variant: str, mode: str) -> dict[str, Contender]:
    (setting, label, _), (base, contenders) = VARIANTS[variant], BASES[mode]
    return {base: contenders[base], f"{base}, {label}": Contender(("llmtune",), setting)}


CONTENDERS = {**PT, **SFT, **INTERLEAVED,
              **{name: c for variant in VARIANTS for mode in BASES for name, c in variant_contenders(variant, mode).items()}}
# (numerator, denominator, goal) of the ratios printed under each table.
RATIOS = {
    "pt": [("llmtune fp32", "HF Trainer fp32", ">= 1.3"), ("llmtune bf16", "HF Trainer bf16", ">= 2"),
           ("llmtune compile", "llmtune fp32", "> 1, or a reason"), ("llmtune fp32", "plain loop", "")],
    "sft": [("llmtune defaults", "llmtune unmasked", ">= 0.98"), ("llmtune defaults", "HF Trainer", ">= 3.5")],
    "interleaved": [(f"{name}: llmtune", f"{name}: plain", "") for name in INTERLEAVED],
    **{variant: [(f"{base}, {label}", base, goal) for base, _ in BASES.values()]
       for variant, (_, label, goal) in VARIANTS.items()},
}


@dataclass
class Workload:
    """What every contender of a benchmark trains on; written by the parent, read by each worker process."""
    task: str  # pt | sft
    model: str  # folder of the model's config.json
    tokenizer: str
    data: str  # pt: documents {"text"}; sft: samples {"input_ids", "labels"} (JSON lines)
    seq: int  # pt: tokens per block of the plain loop and the HF Trainer (llmtune's: llmtune_data's max_seq_len)
    batch: int  # rows per step of the plain loop and the HF Trainer
    llmtune_batch: int  # rows per step of llmtune
    llmtune_data: dict  # the recipe's data section
    steps: int
    warmup: int
    learning_rate: float = LEARNING_RATE

    def write(self, root: Path) -> None:
        (root / "workload.json").write_text(json.dumps(asdict(self)))

    @classmethod
    def read(cls, root: Path) -> "Workload":
        return cls(**json.loads((root / "workload.json").read_text()))


class StepClock:
    """The one way a step is timed: wall time from start() or the previous lap to lap(tokens), with the real
    tokens of the step and, where the loop tells it, its wait for data; the first `warmup` steps are left out of
    result()."""

    def __init__(self, warmup: int):
        self.warmup, self.times, self.tokens, self.data_waits, self.started = warmup, [], [], [], 0.0

    def start(self) -> None:
        self.started = time.perf_counter()

    def lap(self, tokens: int, data_wait: float | None = None) -> None:
        now = time.perf_counter()
        self.times.append(now - self.started)
        self.tokens.append(tokens)
        if data_wait is not None:
            self.data_waits.append(data_wait)
        self.started = now

    def result(self) -> dict:
        result = {"step_times_s": self.times[self.warmup:], "step_tokens": self.tokens[self.warmup:]}
        if self.data_waits:
            result["data_wait_s"] = self.data_waits[self.warmup:]
        return result


def data_wait_frac(result: dict) -> float | None:
    """The share of one run's timed steps spent waiting for data, as metrics.jsonl's data_wait_frac."""
    return sum(result["data_wait_s"]) / sum(result["step_times_s"]) if "data_wait_s" in result else None


def speed(result: dict) -> float:
    """Tokens/s of one run's timed steps."""
    tokens, times = result["step_tokens"], result["step_times_s"]
    if len(set(tokens)) == 1:
        # The median step, which a rare slow one (another process waking up) does not move.
        return tokens[0] / statistics.median(times)
    return sum(tokens) / sum(times)


# --- in a worker process: build one contender and time its steps


def time_steps(runners: dict, workload: Workload) -> dict:
    """{name: StepClock result} of each runner (one step per call, returning the step's real tokens and its wait for
    data, None where the loop does not tell it) over warmup + steps rounds; several runners take turns within a
    round, alternating which goes first."""
    clocks = {name: StepClock(workload.warmup) for name in runners}
    for turn in range(workload.warmup + workload.steps):
        for name in sorted(runners, reverse=turn % 2 == 1):
            clocks[name].start()
            clocks[name].lap(*runners[name]())
    return {name: clock.result() for name, clock in clocks.items()}


def llmtune_recipe(workload: Workload, settings: dict, out: Path) -> Path:
    total = workload.warmup + workload.steps
    recipe = {
        "model": {"config": workload.model, "tokenizer": workload.tokenizer},
        "data": dict(workload.llmtune_data),
        # One record, at the last step: the steps are timed here.
        "train": {"output_dir": str(out), "max_steps": total, "logging_steps": total,
                  "per_device_train_batch_size": workload.llmtune_batch, "learning_rate": workload.learning_rate},
        "checkpoint": {"export_hf": False},
        "monitor": {"console": False},
    }
    for section, values in settings.items():
        recipe.setdefault(section, {}).update(values)
    path = out / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def llmtune_step(workload: Workload, settings: dict, state, out: Path, count: str = "input_tokens"):
    """llmtune's loop as `llmtune pt|sft|dpo` builds it (worker.build_trainer): each call is one Trainer.advance
    (data, token counting, forward/backward, clipping, optimizer, monitor) and returns the step's `count` (a field of
    its StepRecord: by default its non-pad tokens on all ranks; samples: its sequences, or its pairs under dpo) and
    its wait for data, which the trainer has measured already: its train_step is wrapped to catch the step's record,
    which advance completes with the wait."""
    from llmtune.config import load_config
    from llmtune.run.worker import build_trainer
    from llmtune.training.stop_signals import StopSignals
    from llmtune.training.trainer import Trainer

    config = load_config(str(llmtune_recipe(workload, settings, out)), [], workload.task, state.world_size)
    trainer, _ = build_trainer(config, state)
    trainer.model.train()
    trainer.monitor.begin(trainer.step)  # as Trainer.train: the last step's record is written
    steps, records = trainer.data.steps(trainer.total_steps), []
    no_signals = StopSignals([])

    def train_step(micro_batches):
        stats = Trainer.train_step(trainer, micro_batches)
        records.append(stats)
        return stats

    def step() -> tuple[int, float]:
        trainer.advance(steps, no_signals)
        stats = records.pop()
        return getattr(stats, count), stats.data_wait

    trainer.train_step = train_step
    return step


def plain_step(workload: Workload, state):
    from plain_fsdp_loop import PlainLoop

    plain = PlainLoop(workload.model, workload.tokenizer, workload.data, workload.seq, workload.batch,
                      state.fsdp_mesh)

    def step() -> tuple[int, None]:
        plain()
        return plain.tokens_per_step, None

    return step


def run_contender(name: str, workload: Workload, out: Path) -> tuple[dict, bool]:
    """({runner: StepClock result}, whether this process reports them)."""
    contender = CONTENDERS[name]
    if contender.parts == ("hf",):
        from hf_trainer_baseline import train_hf

        clock = StepClock(workload.warmup)
        train_hf(workload, contender.settings, clock, str(out))
        return {name: clock.result()}, True
    from llmtune.run.parallel import ParallelState

    state = ParallelState.initialize()
    build = {"llmtune": lambda: llmtune_step(workload, contender.settings, state, out),
             "plain": lambda: plain_step(workload, state)}
    names = {part: name if len(contender.parts) == 1 else f"{name}: {part}" for part in contender.parts}
    results = time_steps({names[part]: build[part]() for part in contender.parts}, workload)
    state.close()
    return results, state.is_main


def peak_rss_gib() -> float:
    """This process's peak resident memory so far (Linux gives ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def worker(name: str, root: Path) -> None:
    results, reports = run_contender(name, Workload.read(root), Path(tempfile.mkdtemp(dir=root, prefix="run-")))
    if reports:
        print(RESULT + json.dumps({"runners": results, "peak_rss_gib": peak_rss_gib()}), flush=True)


# --- in the parent: the workload, the runs, the table


def write_model(folder: Path, max_positions: int, special_ids: tuple | None = None) -> int:
    """The benchmark's Llama config in `folder`, its (bos, eos, pad) ids `special_ids` (the demo tokenizer's by
    default); returns its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from llmtune.demo.assets import BOS_ID, EOS_ID, PAD_ID

    bos, eos, pad = special_ids or (BOS_ID, EOS_ID, PAD_ID)
    config = LlamaConfig(**MODEL, max_position_embeddings=max_positions, bos_token_id=bos, eos_token_id=eos,
                         pad_token_id=pad)
    config.save_pretrained(str(folder))
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def write_sft_samples(path: Path, count: int, seed: int = 0):
    """`count` samples of random token ids with SFT_LENGTHS' lengths, each a prompt (label -100) and a response;
    returns their lengths."""
    import numpy as np

    from llmtune.demo.assets import EOS_ID, VOCAB_SIZE
    from llmtune.model.loss import IGNORE_INDEX

    rng = np.random.default_rng(seed)
    lengths = np.clip(np.rint(rng.lognormal(SFT_LENGTHS["mu"], SFT_LENGTHS["sigma"], count)),
                      SFT_LENGTHS["shortest"], SFT_LENGTHS["longest"]).astype(int)
    with open(path, "w") as f:
        for length in lengths:
            ids = rng.integers(EOS_ID + 1, VOCAB_SIZE, length).tolist()  # no special token
            prompt = max(1, round(length * rng.uniform(*PROMPT_SHARE)))
            f.write(json.dumps({"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]}) + "\n")
    return lengths


def packed_rows(lengths, row_len: int) -> int:
    """Rows that llmtune packs samples of these lengths into (first-fit-decreasing within its windows)."""
    from llmtune.data.packing import PACK_WINDOW, first_fit_decreasing

    return sum(len(first_fit_decreasing(lengths[start:start + PACK_WINDOW].tolist(), row_len))
               for start in range(0, len(lengths), PACK_WINDOW))


def prepare(root: Path, args) -> Workload:
    """Write the assets, the model config and (sft) the samples under root; print what will be measured."""
    from llmtune.demo.assets import write_demo_assets

    write_demo_assets(root / "assets")
    params = write_model(root / "model", max(args.seq, args.sft_seq))
    common = dict(model=str(root / "model"), tokenizer=str(root / "assets" / "tokenizer"), seq=args.seq,
                  batch=args.batch, steps=args.steps, warmup=args.warmup)
    print(f"Llama {params / 1e6:.1f}M parameters ({MODEL['num_hidden_layers']} layers, hidden "
          f"{MODEL['hidden_size']}, vocab {MODEL['vocab_size']}); {args.steps} steps timed after {args.warmup}, "
          f"{args.repeats} repeat(s), fresh processes per contender and repeat")
    if not args.sft:
        data = str(root / "assets" / "data" / "pt.jsonl")
        print(f"pt: demo corpus in blocks of {args.seq}, {args.batch} blocks per step, {args.nproc} process(es)")
        return Workload(task="pt", data=data, llmtune_batch=args.batch,
                        llmtune_data={"train_files": [data], "max_seq_len": args.seq,
                                      "cache_dir": str(root / "cache")}, **common)
    data = root / "sft.jsonl"
    lengths = write_sft_samples(data, args.samples)
    rows = max(1, round(args.batch * packed_rows(lengths, args.sft_seq) / len(lengths)))
    print(f"sft: {len(lengths)} samples, lengths median {statistics.median(lengths):.0f}, mean {lengths.mean():.0f}, "
          f"{lengths.min()}-{lengths.max()}; HF Trainer {args.batch} samples per step (about "
          f"{args.batch * lengths.mean():.0f} real tokens), llmtune {rows} packed row(s) of {args.sft_seq} per step")
    # sft wants a chat template even where the rows are tokenized already; basic is never rendered here.
    return Workload(task="sft", data=str(data), llmtune_batch=rows,
                    llmtune_data={"train_files": [str(data)], "format": "tokenized", "chat_template": "basic",
                                  "max_seq_len": args.sft_seq, "cache_dir": str(root / "cache")}, **common)


def launch(root: Path, name: str, nproc: int, script: str = __file__) -> dict:
    """Contender `name` in fresh processes (torchrun's for more than one) of `script` (this one, or another benchmark
    that reuses its method): its runners' results and peak RSS."""
    script = [script, "--worker", name, str(root)]
    command = [sys.executable, *script] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *script]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{name} failed (exit {done.returncode}):\n{done.stderr[-6000:]}")
    line = next(line for line in reversed(done.stdout.splitlines()) if line.startswith(RESULT))
    return json.loads(line.removeprefix(RESULT))


def contender_options(parser: argparse.ArgumentParser, contenders: dict) -> None:
    """The options of a benchmark whose contenders take turns or run alone in fresh processes (preference.py, grpo.py,
    rm.py): the steps timed, the repeats, which contenders, the JSON out, and the worker's own."""
    parser.add_argument("--steps", type=int, default=10, help="Timed optimizer steps per run.")
    parser.add_argument("--warmup", type=int, default=2, help="Steps run before the timed ones.")
    parser.add_argument("--repeats", type=int, default=1, help="Runs of every contender, each in a fresh process.")
    parser.add_argument("--contenders", nargs="+", choices=list(contenders), default=list(contenders),
                        metavar="NAME", help=f"Contenders to run, each in fresh processes (default all: "
                                             f"{', '.join(contenders)}).")
    parser.add_argument("--out", type=Path, help="Write the setup, the tables and every run's steps here as JSON.")
    parser.add_argument("--worker", nargs=2, metavar=("CONTENDER", "ROOT"), help=argparse.SUPPRESS)  # in a worker


def run_contenders(args, worker, prepare, needs_trl: bool, report, script: str) -> None:
    """The main of a benchmark with contender_options: in a worker (--worker), worker(contender, root); in the parent,
    TRL's presence checked where a chosen contender needs it (needs_trl), the workload prepare(root, args) ->
    (Workload, setup) writes in a temporary folder, each of args.contenders run args.repeats times (measure), and
    report(runs) -> the tables it printed, by name, written with the setup and the runs to --out."""
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]))
        return
    if needs_trl and not importlib.util.find_spec("trl"):
        raise SystemExit("TRL is not installed: pip install -e '.[bench]', or leave its contenders out (--contenders)")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        workload, setup = prepare(root, args)
        workload.write(root)
        runs = measure(root, args.contenders, 1, args.repeats, script)
    tables = report(runs)
    if args.out:
        args.out.write_text(json.dumps({"setup": setup, **tables, "runs": runs}, indent=1))


def measure(root: Path, names: list[str], nproc: int, repeats: int, script: str = __file__) -> dict[str, list[dict]]:
    """{runner: its result in each repeat}; each repeat runs every contender once (a worker of `script`), in an order
    rotated by one."""
    runs = defaultdict(list)
    for repeat in range(repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            out = launch(root, name, nproc, script)
            for runner, result in out["runners"].items():
                runs[runner].append({**result, "peak_rss_gib": out["peak_rss_gib"]})
    return runs


def print_table(runs: dict[str, list[dict]], ratios: list[tuple[str, str, str]]) -> None:
    """One row per runner (tokens/s: median over repeats), then the ratios of the medians."""
    medians = {runner: statistics.median(speed(r) for r in results) for runner, results in runs.items()}
    width = max(map(len, runs)) + 2
    print(f"\n{'':{width}}{'tokens/s':>10}  {'tokens/step':>11}  {'peak RSS':>8}  {'data wait':>9}  each repeat")
    for runner, results in runs.items():
        tokens = statistics.median(t for r in results for t in r["step_tokens"])
        rss = max(r["peak_rss_gib"] for r in results)
        waits = [data_wait_frac(r) for r in results]
        wait = f"{statistics.median(waits):.2%}" if None not in waits else "-"
        print(f"{runner:{width}}{medians[runner]:>10,.0f}  {tokens:>11,.0f}  {rss:>4.2f} GiB  {wait:>9}  "
              + " ".join(f"{speed(r):,.0f}" for r in results))
    for numerator, denominator, goal in ratios:
        if numerator in medians and denominator in medians:
            print(f"{numerator} / {denominator}: {medians[numerator] / medians[denominator]:.3f}x"
                  + (f" (goal {goal})" if goal else ""))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--sft", action="store_true", help="Measure sft on skewed sample lengths (one process).")
    mode.add_argument("--interleaved", action="store_true",
                      help="Measure llmtune's loop and the plain loop taking turns in the same processes.")
    variant = parser.add_mutually_exclusive_group()
    variant.add_argument("--workers", action="store_const", const="workers", dest="variant",
                         help="Measure llmtune alone, without and with 2 DataLoader workers (pt, or --sft).")
    variant.add_argument("--ema", action="store_const", const="ema", dest="variant",
                         help="Measure llmtune alone, without and with a moving average of the weights (pt, or --sft).")
    parser.add_argument("--steps", type=int, default=30, help="Timed optimizer steps per run.")
    parser.add_argument("--warmup", type=int, default=5, help="Steps run before the timed ones (compilation too).")
    parser.add_argument("--repeats", type=int, default=2, help="Runs of every contender, each in fresh processes.")
    parser.add_argument("--seq", type=int, default=512, help="pt: tokens per block.")
    parser.add_argument("--batch", type=int, default=8,
                        help="Rows per step and process (pt: blocks; sft: the HF Trainer's samples).")
    parser.add_argument("--nproc", type=int, default=1,
                        help="pt and --interleaved: processes of llmtune and the plain loop (the HF Trainer runs "
                             "only with 1).")
    parser.add_argument("--samples", type=int, default=2000, help="sft: samples written.")
    parser.add_argument("--sft-seq", type=int, default=2048, help="sft: llmtune's tokens per packed row.")
    parser.add_argument("--worker", nargs=2, metavar=("CONTENDER", "ROOT"), help=argparse.SUPPRESS)  # in a worker
    args = parser.parse_args()
    if args.sft and args.nproc != 1:
        parser.error("--sft measures one process; leave out --nproc")
    if args.variant and args.interleaved:
        parser.error(f"--{args.variant} measures llmtune alone; leave out --interleaved")
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]))
        return
    mode = "sft" if args.sft else "interleaved" if args.interleaved else "pt"
    contenders = variant_contenders(args.variant, mode) if args.variant else \
        {"pt": PT, "sft": SFT, "interleaved": INTERLEAVED}[mode]
    # On CPU the HF Trainer trains in one process.
    names = [name for name, c in contenders.items() if args.nproc == 1 or "hf" not in c.parts]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prepare(root, args).write(root)
        print_table(measure(root, names, args.nproc, args.repeats), RATIOS[args.variant or mode])


if __name__ == "__main__":
    # Python puts this folder first on sys.path, where benchmarks/peft.py would stand in for the peft package (which
    # transformers imports); last, it still holds plain_fsdp_loop and hf_trainer_baseline.
    HERE = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE] + [str(HERE)]
    main()
