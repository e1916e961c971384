"""`llmtune demo`: generate the assets, pre-train from scratch, measure, fine-tune, measure again, then align the
fine-tuned model on preference pairs (dpo) and read how often it prefers the right sum on held-out pairs.

Runs the real CLI on the recipes in recipes/demo/, from the repository root where they live.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

from llmtune.config import parse_overrides
from llmtune.demo.assets import write_demo_assets
from llmtune.demo.evaluate import exact_match

REPO = Path(__file__).resolve().parents[2]
WORKDIR = Path("runs/demo")


def main(args: list[str]) -> int:
    overrides, nproc = parse_overrides(args)
    # The demo starts over each time it runs: the runs of an earlier demo in runs/demo are replaced.
    launch = ["train.overwrite_output_dir=true", *overrides, *(["--nproc", str(nproc)] if nproc else [])]
    started = time.perf_counter()
    print(f"[demo] generating data, tokenizer and model config under {REPO / WORKDIR / 'assets'}", flush=True)
    write_demo_assets(REPO / WORKDIR / "assets")
    eval_file = str(REPO / WORKDIR / "assets" / "data" / "sft_eval.jsonl")
    accuracy = {}
    for stage in ("pt", "sft", "dpo"):  # each the task of the same name
        print(f"[demo] llmtune {stage} recipes/demo/{stage}.yaml {' '.join(launch)}", flush=True)
        code = subprocess.call([sys.executable, "-m", "llmtune", stage, f"recipes/demo/{stage}.yaml", *launch],
                               cwd=REPO)
        if code:
            return code
        if stage == "dpo":
            continue
        accuracy[stage] = exact_match(str(REPO / WORKDIR / stage / "hf"), eval_file)
        print(f"[demo] exact-match accuracy on held-out prompts after {stage}: {accuracy[stage]:.1%}", flush=True)
    preferred = preference_accuracy(REPO / WORKDIR / "dpo" / "metrics.jsonl")
    print(f"[demo] held-out exact match: before sft {accuracy['pt']:.1%}, after sft {accuracy['sft']:.1%}; held-out "
          f"pairs ranked right: before dpo {preferred[0]:.1%}, after dpo {preferred[-1]:.1%} "
          f"({time.perf_counter() - started:.0f} s in all)")
    return 0


def preference_accuracy(metrics: Path) -> list[float]:
    """eval_rewards/accuracies of every evaluation of a dpo run, in order (the first at step 0, before training)."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r["eval_rewards/accuracies"] for r in records if "eval_rewards/accuracies" in r]
