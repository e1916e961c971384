"""Data pipeline benchmark: tokenization throughput with the cache cold and warm, and the share of
non-pad tokens with packing vs padding on a skewed length distribution.

    python benchmarks/data.py [--samples 20000]

Uses the demo's generated tokenizer; everything is built in a temporary folder.
"""

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from unittest import mock

from transformers import AutoTokenizer

from llmtune.config import DataConfig
from llmtune.data.build import build_datasets, load_or_build
from llmtune.data.templates import apply_recipe_template
from llmtune.demo.assets import write_demo_assets
from llmtune.parallel import ParallelState


def skewed_rows(count: int, seed: int) -> list[dict]:
    """Many short samples and a few long ones (90% of 1-3 sentences, 10% of 20-60)."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        sentences = rng.randint(20, 60) if rng.random() < 0.1 else rng.randint(1, 3)
        text = " ".join(f"{rng.randint(0, 99)} plus {rng.randint(0, 99)} is a sum." for _ in range(sentences))
        rows.append({"prompt": f"Question {i}: {text}", "response": str(rng.randint(0, 198))})
    return rows


def timed_build(data: DataConfig, tokenizer, batch_size: int, state: ParallelState):
    """(seconds, stats, whether it tokenized rather than read the cache)."""
    with mock.patch("llmtune.data.build.build_datasets", wraps=build_datasets) as tokenize:
        started = time.perf_counter()
        _, _, stats = load_or_build("sft", data, tokenizer, 0, batch_size, state)
        return time.perf_counter() - started, stats, tokenize.called


def measure(args, state: ParallelState) -> dict:
    """{packing: (cold seconds, warm seconds, stats)}, built in a temporary folder."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_demo_assets(root / "assets")
        tokenizer = AutoTokenizer.from_pretrained(root / "assets" / "tokenizer")
        apply_recipe_template(tokenizer, "basic")
        path = root / "skewed.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in skewed_rows(args.samples, 0)))
        results = {}
        for packing in (False, True):
            data = DataConfig(train_files=[str(path)], max_seq_len=args.max_seq_len, packing=packing,
                              cache_dir=str(root / "cache"))
            cold, stats, cold_tokenized = timed_build(data, tokenizer, args.batch_size, state)
            warm, _, warm_tokenized = timed_build(data, tokenizer, args.batch_size, state)
            assert cold_tokenized and not warm_tokenized
            results[packing] = (cold, warm, stats)
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    args = parser.parse_args()
    # load_or_build waits for its builder through the process group: here a world of one.
    state = ParallelState.initialize()
    try:
        results = measure(args, state)
    finally:
        state.close()
    cold, warm, padded = results[False]
    print(f"{args.samples} samples, max_seq_len {args.max_seq_len}, micro-batch {args.batch_size} rows")
    print(f"tokenization, cache cold: {args.samples / cold:,.0f} samples/s ({cold:.2f} s)")
    print(f"tokenization, cache warm: {args.samples / warm:,.0f} samples/s ({warm:.2f} s), "
          f"{cold / warm:.1f}x faster")
    packed = results[True][2]
    print(f"padding to the longest in the batch: {padded.efficiency:.1%} non-pad tokens ({padded.samples} rows)")
    print(f"packing:                             {packed.efficiency:.1%} non-pad tokens ({packed.samples} rows), "
          f"{packed.efficiency / padded.efficiency:.2f}x the padded share")


if __name__ == "__main__":
    main()
