"""`llmtune demo`: generate the assets, pre-train from scratch, measure, fine-tune, measure again, then align the
fine-tuned model on preference pairs (dpo) and read how often it prefers the right sum on held-out pairs, then train it
online on its own sampled answers (grpo) and read the reward of its sampled answers to held-out questions before and
after.

Runs the real CLI on the recipes in recipes/demo/, one process (or `--nproc` launch) per stage, in the folder that
holds runs/demo (the repository root). Ctrl-C stops a stage as it stops `llmtune pt|sft|dpo`: the stage saves a
checkpoint and exits 75, and the demo with it; run again, the demo goes on where it stopped (stage_start).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from llmtune.checkpoint.folders import complete_checkpoints
from llmtune.config import parse_overrides
from llmtune.demo.assets import write_demo_assets
from llmtune.errors import Preempted
from llmtune.run.threads import launch_env, usable_cores

REPO = Path(__file__).resolve().parents[2]
WORKDIR = Path("runs/demo")
STAGES = ("pt", "sft", "dpo", "grpo")  # each the task of the same name
# The overrides that say how a stage starts, which the demo then leaves to the user.
START_KEYS = ("train.overwrite_output_dir=", "checkpoint.resume_from_checkpoint=")
# A checkpoint at every epoch's end, the stage's last step included (a Ctrl-C saves one too), the newest kept: run
# again, the demo goes on from it. Given by the demo, not in recipes/demo, which the tour and the tests read as plain
# recipes; the user's own value of either key wins.
SAVES = ("checkpoint.save_epochs=1", "checkpoint.save_total_limit=1")


def main(args: list[str], root: Path = REPO) -> int:
    """root: the folder whose runs/demo the demo writes (the stages' working directory)."""
    overrides, nproc = parse_overrides(args)
    os.environ.update(stage_threads(nproc))
    workdir = root / WORKDIR
    started = time.perf_counter()
    print(f"[demo] generating data, tokenizer and model config under {workdir / 'assets'}", flush=True)
    write_demo_assets(workdir / "assets")
    accuracy = {}
    for stage in STAGES:
        code = run_stage(stage, overrides, nproc, root)
        if code == Preempted.exit_code:
            print(f"[demo] stopped during {stage}, its checkpoint saved: run the demo again (the same command) to go "
                  "on from it", flush=True)
        if code:
            return code
        if stage in ("pt", "sft"):
            accuracy[stage] = evaluations(workdir / stage / "metrics.jsonl", "eval_gen/accuracy")[-1]
            print(f"[demo] exact-match accuracy on held-out prompts after {stage}: {accuracy[stage]:.1%}", flush=True)
    preferred = evaluations(workdir / "dpo" / "metrics.jsonl", "eval_rewards/accuracies")
    rewarded = evaluations(workdir / "grpo" / "metrics.jsonl", "eval_gen/numeric_match")
    print(f"[demo] held-out exact match: before sft {accuracy['pt']:.1%}, after sft {accuracy['sft']:.1%}; held-out "
          f"pairs ranked right: before dpo {preferred[0]:.1%}, after dpo {preferred[-1]:.1%}; held-out answers sampled "
          f"at grpo's temperature with the right sum: before grpo {rewarded[0]:.1%}, after grpo {rewarded[-1]:.1%} "
          f"({time.perf_counter() - started:.0f} s in all)")
    return 0


def stage_threads(nproc: int | None) -> dict[str, str]:
    """The variables that give each process of a stage the threads of a 2-process layout, whether it runs on 1 or 2
    (none where the user set OMP_NUM_THREADS). Why: a sum's rounding may depend on the threads that share it (on
    some CPUs: 1 process with 2 threads and 2 with 1 each parted at step 50 of the demo's pt on an AVX-512 FP16
    machine), and with one thread count 1 process and --nproc 2 are the same run bitwise."""
    processes = max(nproc or 1, 2)
    return launch_env(processes, f"{usable_cores()} cores / {processes}: the demo's threads on 1 or 2 processes "
                                 "alike, the same run bitwise")


def run_stage(stage: str, overrides: list[str], nproc: int | None, root: Path) -> int:
    """`llmtune STAGE recipes/demo/STAGE.yaml` in a process of its own, in root; its exit code."""
    recipe = REPO / "recipes" / "demo" / f"{stage}.yaml"
    if recipe.is_relative_to(root):  # run from the repository: the path as a user types it there
        recipe = recipe.relative_to(root)
    saves = [save for save in SAVES if not any(o.startswith(save.split("=")[0] + "=") for o in overrides)]
    launch = [*stage_start(root / WORKDIR / stage, overrides), *saves, *overrides,
              *(["--nproc", str(nproc)] if nproc else [])]
    print(f"[demo] llmtune {stage} {recipe} {' '.join(launch)}", flush=True)
    return wait_for([sys.executable, "-m", "llmtune", stage, str(recipe), *launch], root)


def stage_start(output_dir: Path, overrides: list[str]) -> list[str]:
    """How a stage starts, as the HF Trainer's example scripts start (run_clm.py: "Checkpoint detected, resuming
    training"): from the newest checkpoint of its output folder where it has one (a stage Ctrl-C stopped goes on; a
    finished one, whose newest checkpoint is its last step, trains no more and exports again), else afresh (the
    export of an earlier demo replaced). The user's train.overwrite_output_dir or checkpoint.resume_from_checkpoint
    decides instead: train.overwrite_output_dir=true starts every stage over."""
    if any(override.startswith(START_KEYS) for override in overrides):
        return []
    if complete_checkpoints(output_dir / "checkpoints"):
        return ["checkpoint.resume_from_checkpoint=auto"]
    return ["train.overwrite_output_dir=true"]


def wait_for(command: list[str], cwd: Path) -> int:
    """Run `command` and wait for its exit code. Ctrl-C on a terminal signals the whole foreground process group: the
    stage saves and exits 75 (train.save_on_signals), so the demo waits for it rather than being interrupted (and
    killing it) itself. A handler of its own, not SIG_IGN: the stage starts with SIGINT's default action, so that a
    Ctrl-C before training still interrupts it (130). Where SIGINT is ignored already, it stays so."""
    held = signal.getsignal(signal.SIGINT)
    if held is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, lambda signum, frame: None)
    try:
        return subprocess.call(command, cwd=cwd)
    finally:
        signal.signal(signal.SIGINT, held)


def evaluations(metrics: Path, key: str) -> list[float]:
    """`key` of every evaluation of a run, in order (the first at step 0 where the recipe evaluates on start):
    eval_gen/accuracy (pt, sft), eval_rewards/accuracies (dpo), eval_gen/numeric_match (grpo)."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r[key] for r in records if key in r]
