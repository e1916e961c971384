"""How often a two-process run fails to exit cleanly: --runs tiny runs of `bin/llmtune sft --nproc 2` (a 2-layer
Llama with hidden 32 from model.config, the demo's sft data, 4 steps, a checkpoint at the end, the HF export),
one after another; prints how many exited non-zero, with each one's exit code and the end of its stderr.

    python benchmarks/stress_exit.py [--runs 50] [--steps 4] [OVERRIDE ...]

OVERRIDE: recipe overrides for every run (section.key=value), e.g. parallel.cp_size=2 checkpoint.async_save=true.

The goal is 0: an earlier version aborted at exit about once in 20 runs ("terminate called without an active
exception", exit -6) after its export.
"""

import argparse
import collections
import os
import subprocess
import tempfile
import time
from pathlib import Path

import yaml
from transformers import LlamaConfig

from llmtune.demo.assets import VOCAB_SIZE, write_demo_assets

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("overrides", nargs="*")
    parsed = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        write_demo_assets(root / "assets")
        LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, max_position_embeddings=256).save_pretrained(root / "model")
        recipe = root / "recipe.yaml"
        recipe.write_text(yaml.safe_dump({
            "model": {"config": str(root / "model"), "tokenizer": str(root / "assets" / "tokenizer")},
            "data": {"train_files": [str(root / "assets" / "data" / "sft_train.jsonl")], "format": "prompt_response",
                     "chat_template": "basic", "max_seq_len": 64, "cache_dir": str(root / "cache")},
            "train": {"output_dir": str(root / "out"), "max_steps": parsed.steps, "per_device_train_batch_size": 4},
            "checkpoint": {"save_steps": parsed.steps, "save_total_limit": 1},
            "monitor": {"console": False}}))
        failures, seconds = [], []
        for number in range(1, parsed.runs + 1):
            started = time.perf_counter()
            # faulthandler: a process that aborts prints the Python stack of every thread, if it still has one
            command = [str(REPO / "bin" / "llmtune"), "sft", str(recipe), *parsed.overrides, "--nproc", "2"]
            result = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                                    env={**os.environ, "PYTHONFAULTHANDLER": "1"})
            seconds.append(time.perf_counter() - started)
            if result.returncode != 0:
                failures.append((number, result.returncode, result.stderr[-1500:]))
                print(f"run {number}: exit {result.returncode}", flush=True)
    for number, code, tail in failures:
        print(f"--- run {number}, exit {code}, end of stderr:\n{tail}")
    codes = collections.Counter(code for _, code, _ in failures)
    print(f"{len(failures)} of {parsed.runs} runs exited non-zero {dict(codes) if codes else ''}; "
          f"{sum(seconds) / len(seconds):.1f} s per run")


if __name__ == "__main__":
    main()
