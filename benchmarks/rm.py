"""Reward modelling on CPU: llmtune rm's speed and memory against TRL's RewardTrainer on the same pairs and model.

    pip install -e '.[bench]'    # TRL, for this benchmark only: llmtune never imports it
    python benchmarks/rm.py [--pairs 128] [--batch 8] [--steps 10] [--warmup 2] [--repeats 1] [--seq 1024]
                            [--length-scale 1] [--contenders NAME ...] [--out results.json]

Workload. preference.py's: --pairs preference pairs in TRL's conversational form with explicit prompt, seeded
(preference.preference_pairs: every prompt's and answer's words counted log-normal, median 24, clipped to [8, 80],
times --length-scale; chosen and rejected drawn apart, so that lengths vary 10x over the pairs and within one), of
words the demo's tokenizer holds whole; the tokenizer carries llmtune's basic chat template, through which both
render prompt + chosen and prompt + rejected: the same token ids (checked before anything runs). The model is
throughput.py's Llama (4 layers, hidden 256, vocab 32,000), its seeded initial weights saved once as a causal LM
(preference.write_weights), and both train it as transformers' LlamaForSequenceClassification with one label, 11.4M
parameters: the decoder and a score head of 256 weights on its last hidden state (the causal LM's lm_head left out).
TRL builds it from the folder itself (RewardTrainer given the path: AutoModelForSequenceClassification, num_labels
1); llmtune rm starts from the same folder and initialises its score head itself. The two heads start from
different random values, which does not change the work of a step. fp32, one process. The loss of both,
-log sigmoid(r_chosen - r_rejected) averaged over a step's pairs (no margin column, no centring term); learning rate
1e-4 (RewardConfig's default, set in llmtune: its own is 5e-5), AdamW without weight decay, clipping at 1.0, dropout
off (both defaults), --warmup + --steps optimizer steps.

Settings. TRL RewardTrainer: RewardConfig's defaults (max_length 1024: no pair here is cut or dropped), its own
collator (each batch of --batch pairs, its chosen and rejected sequences stacked into one batch of 2 x --batch
padded to the longest of them), gradient checkpointing (its default); bf16 off, for fp32 as llmtune (TRL's default
on CPU, autocast to bf16, is another computation). TRL, no checkpointing: the same with gradient_checkpointing
false, the work llmtune does (it checkpoints nothing by default). llmtune rm: its defaults (rm.max_length
data.max_seq_len / 2, no prompt limit, truncation on, dropout off; a cosine schedule where TRL's is linear, which
costs nothing), data.chat_template basic, each step's pairs packed into one row by the collator (each pair's chosen
sequence, then its rejected one without the prompt the chosen one holds: data/collate.share_prefix, each sequence's
score that of the sequence alone), each sequence scored at its last token;
--batch pairs per step, as TRL's (per_device_train_batch_size counts pairs), every pair whole.

Speed. As preference.py: this machine is shared, so llmtune and TRL take turns in one process, step by step, and
see the same machine: after each of TRL's optimizer steps (a callback at on_step_end) one of llmtune rm's, for TRL
with its default and with checkpointing off. llmtune's trainer is built after TRL's, so TRL's steps run under
llmtune's setting of glibc's malloc (run/cpu_memory.py), which speeds them up if anything. Each step is timed by
throughput.py's StepClock (llmtune: one Trainer.advance, data included; TRL: from the end of llmtune's step to its
next on_step_end, data included), the first --warmup left out. Pairs/s: the mean pairs of a timed step over the
median step time (preference.speed): a step's time follows its tokens, about the same at every step, not its pairs
(llmtune's rows hold a varying number), and the median is not moved by a step another process slowed. The ratio is
taken in each process, then its median over --repeats. Goal: llmtune rm / TRL RewardTrainer >= 2 (pairs/s).

Memory (and the speed of each alone): TRL (with and without checkpointing) and llmtune rm each alone in a fresh
process, as grpo.py measures: its peak RSS (ru_maxrss: every page it held, its libraries included), its RSS once its
libraries are imported (torch, transformers, datasets and TRL, or llmtune), and peak - baseline, what the run adds:
weights, gradients, optimizer state, activations, data. Their speeds alone come from separate processes, which meet
the shared machine at different moments: the goal is judged on the speeds taken in turn.
"""
import argparse
import json
import statistics
import sys
import tempfile
from collections import deque
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
# As preference.py: this folder last on sys.path (benchmarks/peft.py must not stand in for the peft package); there it
# gives throughput, hf_trainer_baseline and preference.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE] + [str(HERE)]

from preference import (PAIRS_FILE, pair_options, preference_pairs, rss_gib, sequence_lengths, speed,  # noqa: E402
                        spread, taking_turns, write_jsonl, write_tokenizer, write_weights)
from throughput import (MODEL, RESULT, StepClock, Workload, contender_options, llmtune_step, run_contenders,  # noqa: E402
                        peak_rss_gib, time_steps, write_model)

LEARNING_RATE = 1e-4  # RewardConfig's default
TRL_MAX_LENGTH = 1024  # RewardConfig's default max_length: a pair with a longer sequence is dropped

TRL, NO_CHECKPOINTING, LLMTUNE = "TRL RewardTrainer", "TRL, no checkpointing", "llmtune rm"
# Each TRL contender's RewardConfig arguments beyond the common ones.
TRL_SETTINGS = {TRL: {}, NO_CHECKPOINTING: {"gradient_checkpointing": False}}
# Contender (what one fresh process runs) -> its runners: a TRL contender and llmtune taking turns, or one alone.
CONTENDERS = {"in turn": (TRL, LLMTUNE), "in turn, no checkpointing": (NO_CHECKPOINTING, LLMTUNE),
              **{f"{name} alone": (name,) for name in (*TRL_SETTINGS, LLMTUNE)}}
SPEED_GOAL = ">= 2"  # llmtune rm / TRL RewardTrainer, pairs/s taking turns


def beside(trl: str) -> str:
    """The name of llmtune rm's steps taken in turn with those of TRL contender `trl`."""
    return f"{LLMTUNE}, in turn with {trl}"


# --- in a worker process: build the contenders, time their steps, read their memory


def llmtune_runner(workload: Workload, state, out: Path):
    """One step of llmtune rm per call (throughput.llmtune_step: one Trainer.advance), started from the saved causal
    LM's weights, its tokenized data cached in its own run."""
    workload = replace(workload, llmtune_data={**workload.llmtune_data, "cache_dir": str(out / "cache")})
    return llmtune_step(workload, {"model": {"name_or_path": workload.model, "config": None}}, state, out, "samples")


def trl_trainer(name: str, workload: Workload, out: Path, batch_pairs: deque):
    """TRL contender `name`'s RewardTrainer on the workload, built from the causal LM's folder, its own collator
    wrapped to queue each batch's pairs in `batch_pairs`."""
    import datasets
    from hf_trainer_baseline import SEED as HF_SEED
    from hf_trainer_baseline import counting
    from transformers import AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    with open(workload.data) as f:
        pairs = datasets.Dataset.from_list([json.loads(line) for line in f])
    args = RewardConfig(output_dir=str(out / "trl"), use_cpu=True, seed=HF_SEED,
                        max_steps=workload.warmup + workload.steps, per_device_train_batch_size=workload.batch,
                        learning_rate=workload.learning_rate, bf16=False, save_strategy="no", logging_strategy="no",
                        report_to="none", disable_tqdm=True, **TRL_SETTINGS[name])
    trainer = RewardTrainer(model=workload.model, args=args, train_dataset=pairs,
                            processing_class=AutoTokenizer.from_pretrained(workload.tokenizer))
    trainer.data_collator = counting(trainer.data_collator, batch_pairs, size=lambda row: 1)
    return trainer


def run_turns(trl: str, workload: Workload, out: Path) -> dict:
    """warmup + steps optimizer steps of TRL contender `trl` and as many of llmtune rm's, taking turns
    (preference.taking_turns): {runner: StepClock result}."""
    from llmtune.run.parallel import ParallelState

    batch_pairs = deque()
    trainer = trl_trainer(trl, workload, out, batch_pairs)
    # llmtune's process group and trainer once TRL's accelerator has decided it trains in one CPU process.
    state = ParallelState.initialize()
    (out / "llmtune").mkdir()
    step = llmtune_runner(workload, state, out / "llmtune")
    clocks = {trl: StepClock(workload.warmup), beside(trl): StepClock(workload.warmup)}
    trainer.add_callback(taking_turns(clocks[trl], batch_pairs, clocks[beside(trl)], step))
    trainer.train()
    state.close()
    return {runner: clock.result() for runner, clock in clocks.items()}


def run_alone(runner: str, workload: Workload, out: Path) -> dict:
    """warmup + steps steps of one contender alone, its RSS once its libraries are imported first (the baseline its
    memory is counted from): {runner alone: StepClock result with its baseline}."""
    if runner in TRL_SETTINGS:
        from hf_trainer_baseline import StepTimer
        from trl import RewardTrainer  # noqa: F401 (torch, transformers, datasets, TRL)

        baseline = rss_gib()
        clock, batch_pairs = StepClock(workload.warmup), deque()
        trainer = trl_trainer(runner, workload, out, batch_pairs)
        trainer.add_callback(StepTimer(clock, batch_pairs))
        trainer.train()
        result = clock.result()
    else:
        from llmtune.run.parallel import ParallelState
        from llmtune.run.worker import build_trainer  # noqa: F401 (torch, transformers, datasets, llmtune)

        baseline = rss_gib()
        state = ParallelState.initialize()
        result = time_steps({runner: llmtune_runner(workload, state, out)}, workload)[runner]
        state.close()
    return {f"{runner} alone": {**result, "baseline_rss_gib": baseline}}


def worker(name: str, root: Path) -> None:
    workload, out = Workload.read(root), Path(tempfile.mkdtemp(dir=root, prefix="run-"))
    runners = CONTENDERS[name]
    results = run_turns(runners[0], workload, out) if len(runners) == 2 else run_alone(runners[0], workload, out)
    print(RESULT + json.dumps({"runners": results, "peak_rss_gib": peak_rss_gib()}), flush=True)


# --- in the parent: the data, the model, the runs, the table


def pair_lengths(tokenizer_path: Path, pairs: list[dict]) -> tuple[list[int], list[int]]:
    """(prompt tokens, prompt + chosen and prompt + rejected tokens of each pair): each sequence as llmtune renders it
    (the whole conversation, data/preference.py), checked against TRL's (apply_chat_template, as RewardTrainer
    tokenizes a conversational pair)."""
    from transformers import AutoTokenizer

    from llmtune.data.templates import render, text_ids

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    sequences = []
    for pair in pairs:
        for answer in ("chosen", "rejected"):
            messages = pair["prompt"] + pair[answer]
            ours = text_ids(tokenizer, render(tokenizer, messages, False))
            theirs = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
            if ours != list(theirs):
                raise SystemExit(f"llmtune and TRL render a sequence to different token ids:\n{ours}\n{list(theirs)}")
            sequences.append(len(ours))
    return sequence_lengths(tokenizer_path, [pair["prompt"] for pair in pairs]), sequences


def prepare(root: Path, args) -> tuple[Workload, dict]:
    """Write the tokenizer, the model and the pairs under root; print what will be measured; the workload and the
    setup, for the JSON."""
    tokenizer = write_tokenizer(root)
    params = write_model(root / "model", args.seq)
    write_weights(root / "model")
    pairs = preference_pairs(args.pairs, scale=args.length_scale)
    write_jsonl(root / PAIRS_FILE, pairs)
    prompts, lengths = pair_lengths(tokenizer, pairs)
    if max(lengths) > args.seq // 2:
        raise SystemExit(f"--seq {args.seq}: a sequence of {max(lengths)} tokens would be cut by rm.max_length "
                         f"(--seq / 2); raise --seq")
    if max(lengths) > TRL_MAX_LENGTH:
        raise SystemExit(f"a sequence of {max(lengths)} tokens: TRL would drop its pair (max_length "
                         f"{TRL_MAX_LENGTH}); lower --length-scale")
    pair_tokens = [a + b for a, b in zip(lengths[0::2], lengths[1::2])]
    classifier = params - MODEL["vocab_size"] * MODEL["hidden_size"] + MODEL["hidden_size"]  # lm_head -> score
    setup = {"params": classifier, "pairs": len(pairs), "pairs_per_step": args.batch, "row_tokens": args.seq, "pair_tokens_mean": statistics.mean(pair_tokens),
             "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "learning_rate": LEARNING_RATE}
    print(f"LlamaForSequenceClassification {classifier / 1e6:.1f}M parameters ({MODEL['num_hidden_layers']} layers, "
          f"hidden {MODEL['hidden_size']}, vocab {MODEL['vocab_size']}, one label), fp32, one process; {args.steps} "
          f"steps timed after {args.warmup}, {args.repeats} repeat(s)")
    print(f"{len(pairs)} pairs; tokens: prompt {spread(prompts)}; prompt + answer {spread(lengths)}; pair (both "
          f"sequences) mean {statistics.mean(pair_tokens):.0f}, {spread(pair_tokens)}")
    print(f"{args.batch} pairs per step: TRL's {2 * args.batch} sequences padded to their longest; llmtune's packed "
          "into one row")
    workload = Workload(task="rm", model=str(root / "model"), tokenizer=str(tokenizer), data=str(root / PAIRS_FILE),
                        seq=args.seq, batch=args.batch, llmtune_batch=args.batch,
                        llmtune_data={"train_files": [str(root / PAIRS_FILE)], "chat_template": "basic",
                                      "max_seq_len": args.seq},
                        steps=args.steps, warmup=args.warmup, learning_rate=LEARNING_RATE)
    return workload, setup


def summary(results: list[dict]) -> dict:
    """One runner's figures over its repeats: pairs/s (preference.speed), and the step time and pairs per step, each
    the median of its repeats' medians over the timed steps."""
    return {"pairs_per_s": statistics.median(speed(r) for r in results),
            "step_s": statistics.median(statistics.median(r["step_times_s"]) for r in results),
            "pairs_per_step": statistics.median(statistics.mean(r["step_tokens"]) for r in results),
            "each_repeat": [speed(r) for r in results]}


def speed_table(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per TRL contender run in turn: its figures and those of llmtune rm's steps beside it, and llmtune / TRL in
    each repeat (the same process: the same drift of the machine) and their median."""
    table = {}
    for trl in (name for name in TRL_SETTINGS if name in runs):
        each = [speed(a) / speed(b) for a, b in zip(runs[beside(trl)], runs[trl])]
        table[trl] = {"trl": summary(runs[trl]), "llmtune": summary(runs[beside(trl)]),
                      "ratio": statistics.median(each), "each_repeat": each}
    return table


def alone_table(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Each contender alone in its processes: its figures and memory (the largest over repeats)."""
    table = {}
    for name in (f"{runner} alone" for runner in (*TRL_SETTINGS, LLMTUNE)):
        if name in runs:
            results = runs[name]
            table[name] = {**summary(results), "peak_rss_gib": max(r["peak_rss_gib"] for r in results),
                           "baseline_rss_gib": statistics.median(r["baseline_rss_gib"] for r in results),
                           "added_gib": max(r["peak_rss_gib"] - r["baseline_rss_gib"] for r in results)}
    return table


def figures(row: dict) -> str:
    return (f"{row['pairs_per_s']:>7.2f}  {row['step_s']:>6.3f}s  {row['pairs_per_step']:>10.1f}  "
            + " ".join(f"{s:.2f}" for s in row["each_repeat"]))


def print_tables(speeds: dict[str, dict], alone: dict[str, dict]) -> None:
    header = f"{'pairs/s':>7}  {'step':>7}  {'pairs/step':>10}  each repeat"
    for trl, row in speeds.items():
        width = len(beside(trl)) + 2
        print(f"\nSpeed, taking turns in one process (medians over the timed steps):\n{'':{width}}{header}\n"
              f"{trl:{width}}{figures(row['trl'])}\n{beside(trl):{width}}{figures(row['llmtune'])}\n"
              f"{LLMTUNE} / {trl}: {row['ratio']:.2f}x pairs/s" + (f" (goal {SPEED_GOAL})" if trl == TRL else "")
              + ", each repeat " + " ".join(f"{r:.2f}" for r in row["each_repeat"]))
    if alone:
        width = max(map(len, alone)) + 2
        print(f"\nAlone in a process, speed and memory:\n{'':{width}}{'peak RSS':>9}  {'baseline':>9}  "
              f"{'peak - baseline':>15}  {header}")
        for name, row in alone.items():
            print(f"{name:{width}}{row['peak_rss_gib']:>5.2f} GiB  {row['baseline_rss_gib']:>5.2f} GiB  "
                  f"{row['added_gib']:>11.2f} GiB  {figures(row)}")
        ours = alone.get(f"{LLMTUNE} alone")
        for trl in (f"{name} alone" for name in TRL_SETTINGS if ours and f"{name} alone" in alone):
            print(f"{LLMTUNE} / {trl}: {ours['pairs_per_s'] / alone[trl]['pairs_per_s']:.2f}x pairs/s; peak RSS "
                  f"{ours['peak_rss_gib'] / alone[trl]['peak_rss_gib']:.3f}x, peak - baseline "
                  f"{ours['added_gib'] / alone[trl]['added_gib']:.3f}x")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pair_options(parser, "rm")
    contender_options(parser, CONTENDERS)
    return parser


def report(runs: dict[str, list[dict]]) -> dict:
    speeds, alone = speed_table(runs), alone_table(runs)
    print_tables(speeds, alone)
    return {"speed": speeds, "alone": alone}


def main() -> None:
    args = build_parser().parse_args()
    run_contenders(args, worker, prepare, any(set(CONTENDERS[name]) & set(TRL_SETTINGS) for name in args.contenders),
                   report, __file__)


if __name__ == "__main__":
    main()
