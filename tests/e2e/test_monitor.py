"""TrainMonitor and evaluation, in this process: one record per logging step (and per evaluation) with
every documented field; token counts and throughput agree with independent counts; the logged
validation loss is the token-weighted mean over the whole validation split."""

import time

import pytest
import torch
import torch.nn.functional as F
import yaml
from transformers import AutoModelForCausalLM

from llmtune.config import load_config
from llmtune.data.build import load_or_build
from llmtune.monitor.metrics import peak_tflops
from llmtune.run.parallel import ParallelState
from llmtune.run.worker import build_trainer
from tests.helpers import read_metrics

FIELDS = {"step", "epoch", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "samples_per_s", "step_time_s",
          "data_wait_frac", "tflops", "mfu", "mem_gib", "skipped_steps", "input_tokens", "eta_s"}


@pytest.fixture(scope="module")
def run(tiny_model, assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("monitor")
    rows = (assets / "data" / "sft_train.jsonl").read_text().splitlines()[:50]
    (root / "train.jsonl").write_text("\n".join(rows) + "\n")
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(tiny_model)},
        "data": {"train_files": [str(root / "train.jsonl")], "chat_template": "basic", "packing": False,
                 "val_ratio": 0.2},
        "train": {"output_dir": str(root / "out"), "max_steps": 5, "per_device_train_batch_size": 4,
                  "gradient_accumulation_steps": 2, "logging_steps": 2, "eval_steps": 3, "learning_rate": 1e-3},
    }))
    config = load_config(str(recipe), [], "sft", world_size=1)
    state = ParallelState.initialize()
    try:
        trainer, tokenizer = build_trainer(config, state)
        started = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - started
        trainer.model.eval()
        train, val, _, _ = load_or_build("sft", config.data, tokenizer, config.train.seed, 4, state)
        with torch.no_grad():
            full = {k: v.full_tensor() for k, v in trainer.model.hf_model.state_dict().items()}
    finally:
        state.close()
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model.load_state_dict(full)
    return read_metrics(root / "out"), wall, val, model.eval(), sum(len(ids) for ids in train["input_ids"])


def test_one_record_per_logging_step_and_evaluation_with_every_field(run):
    records, _, _, _, _ = run
    assert [r["step"] for r in records] == [2, 3, 4, 5]
    for record in records:
        assert FIELDS <= record.keys(), FIELDS - record.keys()
        assert (record["mfu"] is None) == (peak_tflops(None) is None), "mfu needs a known peak (none for a CPU)"
        assert record["tflops"] > 0 and record["mem_gib"] > 0 and record["skipped_steps"] == 0
        assert 0 <= record["data_wait_frac"] < 1
    assert [("eval_loss" in r) for r in records] == [False, True, False, True]


def test_token_counts_and_throughput_agree_with_independent_counts(run):
    records, wall, _, _, train_tokens = run
    window_time = sum(r["input_tokens"] / r["tokens_per_s"] for r in records)
    assert window_time == pytest.approx(wall, rel=0.1)
    assert all(r["tokens"] > 0 for r in records)
    # 40 training samples, global batch 8: 5 steps are exactly one epoch, every sample once.
    assert sum(r["input_tokens"] for r in records) == train_tokens
    # epoch is the progress in epochs, as the HF Trainer logs it: one fifth of the epoch a step.
    assert [r["epoch"] for r in records] == pytest.approx([0.4, 0.6, 0.8, 1.0], rel=1e-12)


def test_eval_loss_is_the_token_weighted_mean_over_the_validation_split(run):
    records, _, val, model, _ = run
    assert len(val) == 10
    total, count = 0.0, 0
    with torch.no_grad():
        for row in val:
            ids = torch.tensor([row["input_ids"]])
            labels = torch.tensor(row["labels"][1:] + [-100])
            logits = model(ids).logits[0]
            total += F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum").item()
            count += int((labels != -100).sum())
    assert records[-1]["eval_loss"] == pytest.approx(total / count, rel=1e-5)
