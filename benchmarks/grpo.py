"""Online RL on CPU: llmtune grpo's speed and memory against TRL's GRPOTrainer (transformers' generate, no vLLM) on
the same model, prompts, reward function and generation settings.

    pip install -e '.[bench]'    # TRL, for this benchmark only: llmtune never imports it
    python benchmarks/grpo.py [--workload short|gsm8k-shaped] [--prompts 64] [--batch 8] [--accumulation 2]
                              [--generations 8] [--completion-length N] [--steps 10] [--warmup 2] [--repeats 1]
                              [--contenders NAME ...] [--out results.json]

Workload. --prompts questions in TRL's prompt-only conversational form (a `prompt` column holding one user message,
a `solution` column handed to the reward function), seeded (grpo_prompts): "<context>. What is a + b?", the context
preference.py's words counted as its answers are (log-normal, median 24, clipped to [8, 80]), a and b the demo's
operands (10-49), the solution their sum. The demo's tokenizer (llmtune.demo.assets, 256 tokens) with llmtune's basic
chat template renders them for both, with the generation prompt: the same token ids (checked before anything runs).
The model is throughput.py's Llama (4 layers, hidden 256, MLP 688, 4 heads) with the tokenizer's vocabulary of 256,
3.3M parameters, its seeded initial weights saved once and loaded by both. Untrained, it samples about uniformly over
the 256 tokens: a completion ends at the EOS token (1 in 256) or at --completion-length (at 128, about 60% run to
the limit, the mean is about 100 tokens), so that lengths vary within a round as they do in real rollouts. The
reward (`digits`, TRL's signature, named to llmtune as grpo.reward_funcs: [grpo:digits], this folder on sys.path):
the share of a completion's characters that are digits, plus 1 where its last number is the solution; it differs
within groups, so that the advantages are not all 0.

--workload gsm8k-shaped is a real GRPO run's shape: a system message (a fixed one of 105 of those words) before each
question (a context of 25-110 words), prompts of about 150-250 tokens, 8 completions each of up to 256 tokens
(--completion-length's default there), and a Llama of 8 layers, hidden 512, MLP 1376, 8 heads (25.4M parameters),
so that matmuls, not Python, take the step. A group's prompt is then a large share of its rows: what llmtune computes
once (in the generation's prefill and in the training forward) and TRL once per completion.

Settings, the same on both by TRL's names (llmtune grpo's keys are GRPOConfig's): num_generations --generations,
max_completion_length --completion-length, temperature 1.0, top_p 1.0, top_k 0, loss_type dapo, beta 0 (no
reference model), epsilon 0.2, num_iterations 1; per_device_train_batch_size --batch completions (both count
completions) and gradient_accumulation_steps --accumulation: one generation round of --batch x --accumulation
completions (--batch x --accumulation / --generations prompts) per optimizer step, TRL's default round. Learning
rate 1e-6 (GRPOConfig's default), a linear schedule without warm-up (TrainingArguments', set in llmtune: its own
default is cosine), AdamW without weight decay, clipping at 1.0, seed 42; fp32, one process. Gradient checkpointing
off on both: GRPOConfig turns it on by default, llmtune's default is off, and this compares the same work. TRL:
bf16 off (its CPU default, autocast to bf16, is another computation), its own prompt order (RepeatSampler, shuffled),
each generation round one left-padded batch through transformers' generate, the round's prompts and completions
then padded to the round's longest (each micro-batch of --batch completions as long as the longest prompt + the
longest completion of the round). llmtune: its defaults, the engine's generation (generation/engine.py: each
prompt prefilled once for its group into a static KV cache, transformers' generate decoding, one seeded draw for
the batch a step), each micro-batch one packed row of its prompt + completion sequences, a prompt computed once
for its completions there.

Speed. This machine is shared (benchmarks.md): TRL and llmtune take turns in one process, step by step, and see the
same machine, as preference.py does: after each of TRL's optimizer steps (a callback at on_step_end) one of llmtune
grpo's. Each step is timed by throughput.py's StepClock (llmtune: one Trainer.advance, its generation round
included; TRL: from the end of llmtune's step to its next on_step_end, its generation round included), the first
--warmup left out. Completions/s: a step's completions over the median step time (every step has as many). Each
side's generation round is timed too, with its completions' mean length (medians over the timed steps): llmtune's
from metrics.jsonl (generation/time_s, logged every step: with the round's completions.jsonl lines about 3 ms a
step), TRL's around its _generate_single_turn (transformers' generate and the cut after EOS); the rest of a step
(its time less its generation's: scoring, the loss's forwards and backwards, the optimizer) is printed beside
them. The ratio is taken in each process, then its median over --repeats. Goal (issue 65): llmtune grpo / TRL
GRPOTrainer >= 1.2 completions/s on the short workload, >= 1.6 on gsm8k-shaped. llmtune's trainer is built
after TRL's, so TRL's steps run under llmtune's setting of glibc's malloc (run/cpu_memory.py), as in
preference.py.

Memory (and the speed of each alone): each alone in a fresh process, as preference.py measures: its peak RSS
(ru_maxrss: every page it held, its libraries included), its RSS once its libraries are imported (torch,
transformers, datasets and TRL, or llmtune), and peak - baseline, what the run adds: weights, gradients, optimizer
state, generation caches, activations, data.
"""
import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections import deque
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
# As preference.py: this folder last on sys.path (benchmarks/peft.py must not stand in for the peft package); there it
# gives throughput and preference, and this module to llmtune, which imports the reward function as grpo:digits.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE] + [str(HERE)]

from preference import (LENGTHS, WORDS, rss_gib, speed, spread, taking_turns, write_jsonl,  # noqa: E402
                        write_tokenizer, write_weights)
from throughput import (MODEL, RESULT, StepClock, Workload, contender_options, llmtune_step, run_contenders,  # noqa: E402
                        peak_rss_gib, time_steps, write_model)

from llmtune.generation.scorers import NUMBER, completion_text  # noqa: E402

LEARNING_RATE = 1e-6  # GRPOConfig's default
OPERANDS = (10, 49)  # the demo's (llmtune.demo.assets)
# GRPOConfig's settings that llmtune's grpo section takes by the same names: TRL's defaults, spelled out.
SAMPLING = dict(temperature=1.0, top_p=1.0, top_k=0, loss_type="dapo", beta=0.0, epsilon=0.2, num_iterations=1)
REWARD = f"{Path(__file__).stem}:digits"
PROMPTS_FILE, SETTINGS_FILE = "prompts.jsonl", "grpo.json"

TRL, LLMTUNE = "TRL GRPOTrainer", "llmtune grpo"
# Contender (what one fresh process runs) -> its runners: both taking turns, or one alone.
CONTENDERS = {"in turn": (TRL, LLMTUNE), f"{TRL} alone": (TRL,), f"{LLMTUNE} alone": (LLMTUNE,)}
# --workload: its model shape (on top of throughput.py's MODEL), system message words, question words, completions'
# length, and the goal of llmtune grpo / TRL GRPOTrainer, completions/s taking turns (issue 65's).
WORKLOADS = {
    "short": dict(model={}, system_words=0, question_words=None, completion_length=128, goal=">= 1.2"),
    "gsm8k-shaped": dict(model=dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                                    num_attention_heads=8, num_key_value_heads=8),
                         system_words=105, question_words=(25, 110), completion_length=256, goal=">= 1.6"),
}


def digits(prompts, completions, completion_ids, solution, **kwargs) -> list[float]:
    """The benchmark's reward, TRL's signature: the share of a completion's characters that are digits, plus 1 where
    its last number is the solution."""
    rewards = []
    for completion, answer in zip(completions, solution):
        text = completion_text(completion)
        numbers = NUMBER.findall(text)
        solved = bool(numbers) and numbers[-1] == answer
        rewards.append(sum(c.isdigit() for c in text) / max(len(text), 1) + float(solved))
    return rewards


def grpo_prompts(count: int, workload: dict, seed: int = 0) -> list[dict]:
    """`count` rows in TRL's prompt-only conversational form: a user's question after a context of LENGTHS' word
    count (or of the workload's question_words, uniform), after the workload's system message where it has one, and
    its `solution`."""
    rng = random.Random(seed)
    system = [{"role": "system", "content": " ".join(rng.choice(WORDS) for _ in range(workload["system_words"]))}] \
        if workload["system_words"] else []
    rows = []
    for _ in range(count):
        if workload["question_words"]:
            words = rng.randint(*workload["question_words"])
        else:
            words = round(min(max(rng.lognormvariate(LENGTHS["mu"], LENGTHS["sigma"]), LENGTHS["shortest"]),
                              LENGTHS["longest"]))
        context = " ".join(rng.choice(WORDS) for _ in range(words))
        a, b = rng.randint(*OPERANDS), rng.randint(*OPERANDS)
        rows.append({"prompt": [*system, {"role": "user", "content": f"{context}. What is {a} + {b}?"}],
                     "solution": str(a + b)})
    return rows


# --- in a worker process: build the contenders, time their steps, read their memory


def read_settings(root: Path) -> dict:
    """{"grpo": GRPOConfig's settings by the names both take, "accumulation": gradient_accumulation_steps}."""
    return json.loads((root / SETTINGS_FILE).read_text())


def completions_per_step(workload: Workload, settings: dict) -> int:
    return workload.batch * settings["accumulation"]


def llmtune_runner(workload: Workload, settings: dict, state, out: Path):
    """One step of llmtune grpo per call (throughput.llmtune_step: one Trainer.advance), started from the saved
    weights, a record in metrics.jsonl every step (for its generation time)."""
    workload = replace(workload, llmtune_data={**workload.llmtune_data, "cache_dir": str(out / "cache")})
    recipe = {"model": {"name_or_path": workload.model, "config": None},
              "train": {"gradient_accumulation_steps": settings["accumulation"], "lr_scheduler_type": "linear",
                        "logging_steps": 1},
              "grpo": {**settings["grpo"], "reward_funcs": [REWARD]}}
    return llmtune_step(workload, recipe, state, out, "samples")


def llmtune_rounds(out: Path, warmup: int) -> dict:
    """The timed steps' generation times and mean completion lengths, from llmtune's metrics.jsonl."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "generation/time_s" in r][warmup:]
    return {"generation_s": [r["generation/time_s"] for r in records],
            "completion_length": [r["completions/mean_length"] for r in records]}


def trl_trainer(workload: Workload, settings: dict, out: Path, rounds: dict):
    """TRL's GRPOTrainer on the workload, its generation rounds timed into `rounds` (generation_s, completion_length:
    one value per round)."""
    import datasets
    import torch
    from hf_trainer_baseline import SEED as HF_SEED
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(workload.model, dtype=torch.float32)
    with open(workload.data) as f:
        prompts = datasets.Dataset.from_list([json.loads(line) for line in f])
    args = GRPOConfig(output_dir=str(out / "trl"), use_cpu=True, seed=HF_SEED,
                      max_steps=workload.warmup + workload.steps, per_device_train_batch_size=workload.batch,
                      gradient_accumulation_steps=settings["accumulation"], learning_rate=workload.learning_rate,
                      bf16=False, gradient_checkpointing=False, save_strategy="no", logging_strategy="no",
                      report_to="none", disable_tqdm=True, **settings["grpo"])
    trainer = GRPOTrainer(model=model, reward_funcs=[digits], args=args, train_dataset=prompts,
                          processing_class=AutoTokenizer.from_pretrained(workload.tokenizer))
    generate = trainer._generate_single_turn

    def timed_generate(*given, **named):
        started = time.perf_counter()
        completion_ids, logprobs = generate(*given, **named)
        rounds["generation_s"].append(time.perf_counter() - started)
        rounds["completion_length"].append(statistics.mean(map(len, completion_ids)))
        return completion_ids, logprobs

    trainer._generate_single_turn = timed_generate
    return trainer


def trl_result(clock: StepClock, rounds: dict, warmup: int) -> dict:
    return {**clock.result(), **{key: values[warmup:] for key, values in rounds.items()}}


def run_turns(workload: Workload, settings: dict, out: Path) -> dict:
    """warmup + steps optimizer steps of TRL's GRPOTrainer and as many of llmtune grpo's, taking turns (preference.py's
    callback): {runner: StepClock result with its generation rounds}."""
    from llmtune.run.parallel import ParallelState

    rounds = {"generation_s": [], "completion_length": []}
    trainer = trl_trainer(workload, settings, out, rounds)
    # llmtune's process group and trainer once TRL's accelerator has decided it trains in one CPU process.
    state = ParallelState.initialize()
    (out / "llmtune").mkdir()
    step = llmtune_runner(workload, settings, state, out / "llmtune")
    clocks = {TRL: StepClock(workload.warmup), LLMTUNE: StepClock(workload.warmup)}
    total = workload.warmup + workload.steps
    trainer.add_callback(taking_turns(clocks[TRL], deque([completions_per_step(workload, settings)] * total),
                                      clocks[LLMTUNE], step))
    trainer.train()
    state.close()
    return {TRL: trl_result(clocks[TRL], rounds, workload.warmup),
            LLMTUNE: {**clocks[LLMTUNE].result(), **llmtune_rounds(out / "llmtune", workload.warmup)}}


def run_alone(runner: str, workload: Workload, settings: dict, out: Path) -> dict:
    """warmup + steps steps of one side alone, its RSS once its libraries are imported first (the baseline its memory
    is counted from): {runner: StepClock result with its generation rounds and baseline}."""
    if runner == TRL:
        from hf_trainer_baseline import StepTimer
        from trl import GRPOTrainer  # noqa: F401 (torch, transformers, datasets, TRL)

        baseline = rss_gib()
        clock, rounds = StepClock(workload.warmup), {"generation_s": [], "completion_length": []}
        trainer = trl_trainer(workload, settings, out, rounds)
        total = workload.warmup + workload.steps
        trainer.add_callback(StepTimer(clock, deque([completions_per_step(workload, settings)] * total)))
        trainer.train()
        return {f"{TRL} alone": {**trl_result(clock, rounds, workload.warmup), "baseline_rss_gib": baseline}}
    from llmtune.run.parallel import ParallelState
    from llmtune.run.worker import build_trainer  # noqa: F401 (torch, transformers, datasets, llmtune)

    baseline = rss_gib()
    state = ParallelState.initialize()
    name = f"{LLMTUNE} alone"
    result = time_steps({name: llmtune_runner(workload, settings, state, out)}, workload)[name]
    state.close()
    return {name: {**result, **llmtune_rounds(out, workload.warmup), "baseline_rss_gib": baseline}}


def worker(name: str, root: Path) -> None:
    workload, settings = Workload.read(root), read_settings(root)
    out = Path(tempfile.mkdtemp(dir=root, prefix="run-"))
    runners = CONTENDERS[name]
    results = run_turns(workload, settings, out) if len(runners) == 2 else \
        run_alone(runners[0], workload, settings, out)
    print(RESULT + json.dumps({"runners": results, "peak_rss_gib": peak_rss_gib()}), flush=True)


# --- in the parent: the data, the model, the runs, the table


def write_policy(folder: Path, vocab_size: int, max_positions: int, shape: dict) -> int:
    """throughput.py's Llama with the tokenizer's vocabulary and the workload's `shape`, its seeded initial weights
    (preference.write_weights): what both sides load. Returns its parameter count."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    write_model(folder, max_positions)
    config = AutoConfig.from_pretrained(str(folder))
    for key, value in {**shape, "vocab_size": vocab_size}.items():
        setattr(config, key, value)
    config.save_pretrained(str(folder))
    write_weights(folder)
    return sum(tensor.numel() for tensor in load_file(str(folder / "model.safetensors")).values())


def prompt_lengths(tokenizer_path: Path, rows: list[dict]) -> list[int]:
    """Each prompt's tokens as llmtune renders it (data/prompts.prompt_ids), checked against TRL's rendering
    (apply_chat_template with the generation prompt, as GRPOTrainer._tokenize_prompts calls it)."""
    from transformers import AutoTokenizer

    from llmtune.data.prompts import prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    lengths = []
    for row in rows:
        ours = prompt_ids(tokenizer, row["prompt"])
        theirs = tokenizer.apply_chat_template([row["prompt"]], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"][0]
        if ours != list(theirs):
            raise SystemExit(f"llmtune and TRL render a prompt to different token ids:\n{ours}\n{list(theirs)}")
        lengths.append(len(ours))
    return lengths


def prepare(root: Path, args) -> tuple[Workload, dict]:
    """Write the tokenizer, the model, the prompts and the settings under root; print what will be measured; the
    workload and the setup, for the JSON."""
    from llmtune.demo.assets import VOCAB_SIZE

    shape = WORKLOADS[args.workload]
    completion_length = args.completion_length or shape["completion_length"]
    per_step = args.batch * args.accumulation
    if per_step % args.generations:
        raise SystemExit(f"--batch x --accumulation = {per_step} completions a step: not a whole number of groups of "
                         f"--generations {args.generations}")
    tokenizer = write_tokenizer(root)
    rows = grpo_prompts(args.prompts, shape)
    write_jsonl(root / PROMPTS_FILE, rows)
    lengths = prompt_lengths(tokenizer, rows)
    params = write_policy(root / "model", VOCAB_SIZE, max(lengths) + completion_length, shape["model"])
    settings = {"grpo": {"num_generations": args.generations, "max_completion_length": completion_length,
                         **SAMPLING},
                "accumulation": args.accumulation}
    (root / SETTINGS_FILE).write_text(json.dumps(settings))
    setup = {"workload": args.workload, "goal": shape["goal"], "params": params, "prompts": len(rows),
             "prompt_tokens": lengths, "completions_per_step": per_step,
             "prompts_per_step": per_step // args.generations, "per_device_train_batch_size": args.batch,
             "gradient_accumulation_steps": args.accumulation, **settings["grpo"], "learning_rate": LEARNING_RATE,
             "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats}
    model = {**MODEL, **shape["model"]}
    print(f"{args.workload} workload: Llama {params / 1e6:.1f}M parameters ({model['num_hidden_layers']} layers, "
          f"hidden {model['hidden_size']}, vocab {VOCAB_SIZE}), fp32, one process; {args.steps} steps timed after "
          f"{args.warmup}, {args.repeats} repeat(s)")
    print(f"{len(rows)} prompts of {spread(lengths)} tokens; a step: {per_step // args.generations} prompts x "
          f"{args.generations} generations = {per_step} completions of at most {completion_length} tokens, "
          f"micro-batches of {args.batch} completions, {args.accumulation} per step; goal: {LLMTUNE} / {TRL} "
          f"{shape['goal']} completions/s taking turns")
    workload = Workload(task="grpo", model=str(root / "model"), tokenizer=str(tokenizer),
                        data=str(root / PROMPTS_FILE), seq=max(lengths) + completion_length, batch=args.batch,
                        llmtune_batch=args.batch, llmtune_data={"train_files": [str(root / PROMPTS_FILE)]},
                        steps=args.steps, warmup=args.warmup, learning_rate=LEARNING_RATE)
    return workload, setup


def summary(results: list[dict]) -> dict:
    """One runner's figures over its repeats: completions/s, step time, generation time, the rest of the step (the
    scoring, the loss's forwards and backwards, the optimizer) and completion length, each the median of its repeats'
    medians over the timed steps."""
    def median(values_of):
        return statistics.median(statistics.median(values_of(r)) for r in results)

    return {"completions_per_s": statistics.median(speed(r) for r in results),
            "step_s": median(lambda r: r["step_times_s"]), "generation_s": median(lambda r: r["generation_s"]),
            "rest_s": median(lambda r: [a - b for a, b in zip(r["step_times_s"], r["generation_s"])]),
            "completion_length": median(lambda r: r["completion_length"]), "each_repeat": [speed(r) for r in results]}


def speed_table(runs: dict[str, list[dict]]) -> dict:
    """Both sides taking turns: each one's figures, and llmtune / TRL in each repeat (the same process) and their
    median."""
    if TRL not in runs:
        return {}
    each = [speed(a) / speed(b) for a, b in zip(runs[LLMTUNE], runs[TRL])]
    return {TRL: summary(runs[TRL]), LLMTUNE: summary(runs[LLMTUNE]),
            "ratio": statistics.median(each), "each_repeat": each}


def alone_table(runs: dict[str, list[dict]]) -> dict:
    """Each side alone in its processes: its figures and memory (the largest over repeats)."""
    table = {}
    for name in (f"{TRL} alone", f"{LLMTUNE} alone"):
        if name in runs:
            results = runs[name]
            table[name] = {**summary(results), "peak_rss_gib": max(r["peak_rss_gib"] for r in results),
                           "baseline_rss_gib": statistics.median(r["baseline_rss_gib"] for r in results),
                           "added_gib": max(r["peak_rss_gib"] - r["baseline_rss_gib"] for r in results)}
    return table


def print_tables(speeds: dict, alone: dict) -> None:
    header = f"{'completions/s':>13}  {'step':>7}  {'generation':>10}  {'rest':>7}  {'completion':>10}"
    if speeds:
        width = max(len(TRL), len(LLMTUNE)) + 2
        print(f"\nSpeed, taking turns in one process (medians over the timed steps):\n{'':{width}}{header}  "
              f"each repeat\n{'':{width}}{'':>13}  {'':>7}  {'':>10}  {'':>7}  {'tokens':>10}")
        for name in (TRL, LLMTUNE):
            row = speeds[name]
            print(f"{name:{width}}{row['completions_per_s']:>13.2f}  {row['step_s']:>6.2f}s  "
                  f"{row['generation_s']:>9.2f}s  {row['rest_s']:>6.2f}s  {row['completion_length']:>10.1f}  "
                  + " ".join(f"{s:.2f}" for s in row["each_repeat"]))
        print(f"{LLMTUNE} / {TRL}: {speeds['ratio']:.2f}x completions/s, each repeat "
              + " ".join(f"{r:.2f}" for r in speeds["each_repeat"]))
    if alone:
        width = max(map(len, alone)) + 2
        print(f"\nAlone in a process, speed and memory:\n{'':{width}}{header}  {'peak RSS':>9}  {'baseline':>9}  "
              f"{'peak - baseline':>15}")
        for name, row in alone.items():
            print(f"{name:{width}}{row['completions_per_s']:>13.2f}  {row['step_s']:>6.2f}s  "
                  f"{row['generation_s']:>9.2f}s  {row['rest_s']:>6.2f}s  {row['completion_length']:>10.1f}  "
                  f"{row['peak_rss_gib']:>5.2f} GiB  {row['baseline_rss_gib']:>5.2f} GiB  "
                  f"{row['added_gib']:>11.2f} GiB")
        if len(alone) == 2:
            ours, theirs = alone[f"{LLMTUNE} alone"], alone[f"{TRL} alone"]
            print(f"{LLMTUNE} / {TRL} alone: {ours['completions_per_s'] / theirs['completions_per_s']:.2f}x "
                  f"completions/s; peak RSS {ours['peak_rss_gib'] / theirs['peak_rss_gib']:.3f}x, peak - baseline "
                  f"{ours['added_gib'] / theirs['added_gib']:.3f}x")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64, help="Prompts written (one epoch of data).")
    parser.add_argument("--batch", type=int, default=8,
                        help="per_device_train_batch_size: completions per micro-batch (both sides count completions).")
    parser.add_argument("--accumulation", type=int, default=2,
                        help="gradient_accumulation_steps: micro-batches per optimizer step (one generation round).")
    parser.add_argument("--generations", type=int, default=8, help="num_generations: completions per prompt.")
    parser.add_argument("--completion-length", type=int, default=None,
                        help="max_completion_length: the most tokens of a completion (default: the workload's, 128 "
                             "or 256).")
    parser.add_argument("--workload", choices=list(WORKLOADS), default="short",
                        help="short: 45-token prompts, a 3.3M model (the default); gsm8k-shaped: a system message and "
                             "a question of 150-250 tokens, a 25M model, completions of up to 256 tokens.")
    contender_options(parser, CONTENDERS)
    return parser


def report(runs: dict[str, list[dict]]) -> dict:
    speeds, alone = speed_table(runs), alone_table(runs)
    print_tables(speeds, alone)
    return {"speed": speeds, "alone": alone}


def main() -> None:
    args = build_parser().parse_args()
    run_contenders(args, worker, prepare, any(TRL in CONTENDERS[name] for name in args.contenders), report, __file__)


if __name__ == "__main__":
    main()
