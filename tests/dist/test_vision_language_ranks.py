"""A vision-language model (a tiny Qwen2-VL, its vision tower trained too) on 2 processes: the step of 4 samples split
as 2 ranks x accumulation 2 gives the losses and gradient norms of one process x accumulation 4 (fp32, 1e-5), padded
rows here, packed ones in the Qwen3-VL-MoE case (packed and padded rows give the same losses on one process:
tests/e2e/test_vision_language.py); each rank's micro-batches without images still run the sharded vision tower (a
rank that skipped it would leave the other waiting in its all-gathers)."""

import pytest
import yaml

import llmtune
from tests.helpers import read_metrics, run_cli
from tests.vision_models import FAMILY, image_conversations, tiny_vlm


def recipe(vlm, conversations, output_dir, packing: bool, accumulation: int) -> dict:
    return {"model": {"name_or_path": str(vlm)},
            "data": {"dataset_info": str(conversations), "datasets": ["mllm"], "max_seq_len": 256, "packing": packing,
                     "cache_dir": str(output_dir.parent / "cache")},
            "train": {"output_dir": str(output_dir), "max_steps": 4, "learning_rate": 2e-3, "warmup_ratio": 0,
                      "logging_steps": 1, "per_device_train_batch_size": 1,
                      "gradient_accumulation_steps": accumulation, "freeze_vision_tower": False,
                      "freeze_multi_modal_projector": False},
            "checkpoint": {"export_hf": False}}


def test_two_ranks_train_as_one(tmp_path):
    vlm = tiny_vlm(tmp_path / "model")
    conversations = image_conversations(tmp_path / "mllm", copies=4)
    llmtune.train("sft", recipe(vlm, conversations, tmp_path / "one", False, 4))
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(recipe(vlm, conversations, tmp_path / "two", False, 2)))
    result = run_cli("sft", str(path), "--nproc", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert len(one) == len(two) == 4
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in two] == pytest.approx([r[key] for r in one], rel=1e-5), key


def test_qwen3_vl_moe_with_expert_parallelism_trains_as_one_rank(tmp_path):
    """Qwen3-VL-MoE's experts split over 2 ranks (parallel.expert_parallel 2), its experts read from the layout
    save_pretrained writes (transposed against the model's, which transformers converts): the losses of one rank."""
    vlm = tiny_vlm(tmp_path / "model", FAMILY["Qwen3-VL-MoE"])
    conversations = image_conversations(tmp_path / "mllm", copies=4)
    llmtune.train("sft", recipe(vlm, conversations, tmp_path / "one", True, 4))
    config = recipe(vlm, conversations, tmp_path / "two", True, 2)
    config["parallel"] = {"expert_parallel": 2}
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(config))
    result = run_cli("sft", str(path), "--nproc", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in two] == pytest.approx([r[key] for r in one], rel=1e-5), key
