"""Checkpoint costs on one process: checkpoint size against model + optimizer size, the training stall of a
synchronous and of an asynchronous save, the export time, and the peak RSS growth of the export
against the model's size in the export dtype.

    python benchmarks/checkpoint.py [--hidden 512] [--layers 8]
"""

import argparse
import json
import resource
import tempfile
import threading
import time
from pathlib import Path

import yaml
from transformers import AutoTokenizer, LlamaConfig

from llmtune.checkpoint.hf_export import export_trained
from llmtune.config import load_config
from llmtune.demo.assets import write_demo_assets
from llmtune.run.parallel import ParallelState
from llmtune.run.worker import build_trainer


class RssPeak:
    """The highest RSS seen while the block runs, sampled every 2 ms (the process's lifetime peak
    would be the training step's, not the export's)."""

    def __enter__(self):
        self.start = self.peak = self.rss()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, self.rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()


def folder_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def run(root: Path, assets: Path, model_dir: Path, async_save: bool) -> dict:
    recipe = root / f"recipe_{async_save}.yaml"
    out = root / f"out_{async_save}"
    recipe.write_text(yaml.safe_dump({
        "model": {"config": str(model_dir), "tokenizer": str(assets / "tokenizer")},
        "data": {"train_files": [str(assets / "data" / "pt.jsonl")], "max_seq_len": 128, "cache_dir": str(root)},
        "train": {"output_dir": str(out), "max_steps": 6, "per_device_train_batch_size": 4, "logging_steps": 6},
        "checkpoint": {"save_steps": 2, "async_save": async_save, "export_hf": False},
        "monitor": {"console": False},
    }))
    config = load_config(str(recipe), [], "pt", world_size=1)
    state = ParallelState.initialize()
    try:
        trainer, tokenizer = build_trainer(config, state)
        result = {}
        if not async_save:
            # Exported before training: afterwards, memory freed by training would hide the export's own.
            started = time.perf_counter()
            with RssPeak() as peak:
                export_trained(trainer.model.hf_model, tokenizer, out, config.checkpoint, state, trainer.features)
            result["export_s"] = time.perf_counter() - started
            result["export_rss_growth_mib"] = (peak.peak - peak.start) / 2**20
        trainer.train()
        result.update(stalls=trainer.checkpoints.stall_seconds, params=sum(p.numel() for p in trainer.model.parameters()),
                      checkpoint_mib=folder_mib(out / "checkpoints" / "global_step_6"))
    finally:
        state.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        assets = root / "assets"
        write_demo_assets(assets)
        model_dir = root / "model"
        vocab = len(AutoTokenizer.from_pretrained(assets / "tokenizer"))
        LlamaConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                    num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                    tie_word_embeddings=False).save_pretrained(model_dir)
        sync, background = run(root, assets, model_dir, False), run(root, assets, model_dir, True)
    fp32_mib = sync["params"] * 4 / 2**20
    print(f"Llama hidden {args.hidden}, {args.layers} layers: {sync['params'] / 1e6:.1f}M parameters, "
          f"{fp32_mib:.0f} MiB fp32; AdamW adds 2 x {fp32_mib:.0f} MiB")
    print(f"checkpoint folder: {sync['checkpoint_mib']:.0f} MiB = {sync['checkpoint_mib'] / (3 * fp32_mib):.2f}x "
          "(model + optimizer moments, fp32)")
    print(f"stall per save, synchronous:  {json.dumps([round(s, 3) for s in sync['stalls']])} s")
    print(f"stall per save, asynchronous: {json.dumps([round(s, 3) for s in background['stalls']])} s "
          "(the last save is waited for at the end)")
    bf16_mib = sync["params"] * 2 / 2**20
    print(f"bf16 export (before training): {sync['export_s']:.2f} s; peak RSS grew {sync['export_rss_growth_mib']:.0f} MiB "
          f"= {sync['export_rss_growth_mib'] / bf16_mib:.2f}x the model in bf16 ({bf16_mib:.0f} MiB)")


if __name__ == "__main__":
    main()
