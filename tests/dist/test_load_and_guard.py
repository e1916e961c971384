"""2 processes, one launch: pretrained weights load shard by shard (each rank's peak RSS grows by far
less than the model's fp32 size, and the weights are exactly the file's), and a NaN on one rank
skips the step on every rank, with the run stopped after max_skipped_steps in a row."""

import json
import subprocess
import sys

import pytest
import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

from tests.helpers import REPO


@pytest.fixture(scope="module")
def reports(tiny_model, sft_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("load_and_guard")
    config = LlamaConfig(vocab_size=16000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    torch.manual_seed(0)
    big = LlamaForCausalLM(config)
    fp32_mib = sum(p.numel() for p in big.parameters()) * 4 / 2**20
    big.to(torch.bfloat16).save_pretrained(root / "big")
    del big  # 250 MiB, not needed while the workers run
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(tiny_model)},
        "data": {"train_files": [str(sft_file)], "chat_template": "basic", "packing": False},
        "train": {"output_dir": str(root / "out"), "max_steps": 8, "per_device_train_batch_size": 2,
                  "logging_steps": 1, "max_skipped_steps": 3, "learning_rate": 1e-3},
    }))
    out = root / "reports.jsonl"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             str(REPO / "tests" / "dist" / "load_and_guard_worker.py"), str(root / "big"), str(recipe),
                             str(out)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()], fp32_mib, root


def test_each_rank_loads_only_its_shard(reports):
    ranks, fp32_mib, _ = reports
    assert len(ranks) == 2
    for report in ranks:
        assert report["mismatched"] == []
        ratio = report["load_rss_growth_mib"] / fp32_mib
        print(f"rank {report['rank']}: peak RSS grew {report['load_rss_growth_mib']:.0f} MiB while loading a "
              f"{fp32_mib:.0f} MiB (fp32) model: {ratio:.2f}x")
        assert ratio < 0.75


def test_nan_on_one_rank_skips_the_step_on_every_rank_and_stops_the_run(reports):
    ranks, _, root = reports
    for report in ranks:
        changed = {int(step): v for step, v in report["weights_changed"].items()}
        assert changed == {1: True, 2: False, 3: True, 4: False, 5: False, 6: False}, report["rank"]
        assert report["last_step"] == 6
        assert report["stopped"].startswith("stopped at step 6: 3 optimizer steps in a row had a non-finite loss")
    metrics = [json.loads(line) for line in (root / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [m["skipped_steps"] for m in metrics] == [0, 1, 1, 2, 3, 4]
