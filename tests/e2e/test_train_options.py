"""Training options change how the work is done, not the numbers (fp32, one process): the chunked loss
and activation checkpointing give the per-step losses and final weights of the plain run, and
torch.compile and deterministic algorithms its losses (the latter also set what CUDA's cuBLAS needs to
run them); bf16 stays within bf16 rounding of them."""

import os

import pytest
import torch
import yaml

from llmtune.config import load_config
from llmtune.run.parallel import ParallelState
from llmtune.run.worker import build_trainer
from tests.helpers import read_metrics


@pytest.fixture(scope="module")
def train(tiny_model, sft_file, tmp_path_factory):
    def run(*overrides: str) -> tuple[list[float], dict[str, torch.Tensor]]:
        root = tmp_path_factory.mktemp("options")
        recipe = root / "recipe.yaml"
        recipe.write_text(yaml.safe_dump({
            "model": {"name_or_path": str(tiny_model)},
            "data": {"train_files": [str(sft_file)], "chat_template": "basic", "max_seq_len": 64},
            "train": {"output_dir": str(root), "max_steps": 3, "per_device_train_batch_size": 4,
                      "logging_steps": 1, "learning_rate": 2e-3},
        }))
        config = load_config(str(recipe), list(overrides), "sft", world_size=1)
        state = ParallelState.initialize()
        try:
            trainer, _ = build_trainer(config, state)
            trainer.train()
            weights = {k: v.full_tensor() for k, v in trainer.model.hf_model.state_dict().items()}
        finally:
            state.close()
        return [m["loss"] for m in read_metrics(root)], weights
    return run


@pytest.fixture(scope="module")
def plain(train):
    return train("train.chunk_loss_size=0")


@pytest.mark.parametrize("option", ["train.chunk_loss_size=16", "train.gradient_checkpointing=true"])
def test_option_gives_the_same_losses_and_weights(train, plain, option):
    losses, weights = train(option, "train.chunk_loss_size=0" if "chunk" not in option else option)
    assert losses == pytest.approx(plain[0], rel=1e-5)
    for key, value in weights.items():
        torch.testing.assert_close(value, plain[1][key], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_compile_gives_the_same_losses(train, plain):
    assert train("train.compile=true", "train.chunk_loss_size=0")[0] == pytest.approx(plain[0], rel=1e-5)


# What transformers' enable_full_determinism sets: without CUBLAS_WORKSPACE_CONFIG, cuBLAS raises on CUDA as soon
# as deterministic algorithms are on.
DETERMINISM_ENV = ("CUBLAS_WORKSPACE_CONFIG", "CUDA_LAUNCH_BLOCKING", "FLASH_ATTENTION_DETERMINISTIC",
                   "ASCEND_LAUNCH_BLOCKING", "HCCL_DETERMINISTIC")


def test_deterministic_sets_what_cuda_needs_and_keeps_the_losses(train, plain, monkeypatch):
    for name in DETERMINISM_ENV:
        monkeypatch.delenv(name, raising=False)  # restored after the test, as the switches below
    try:
        losses, _ = train("train.deterministic=true", "train.chunk_loss_size=0")
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") in (":16:8", ":4096:8")
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, False
    assert losses == pytest.approx(plain[0], rel=1e-5)


def test_bf16_stays_within_bf16_rounding(train, plain):
    bf16, _ = train("train.bf16=true")
    assert bf16 == pytest.approx(plain[0], rel=2e-2)
    assert bf16 != plain[0]


def test_profiler_writes_a_trace_of_the_chosen_steps(train, tmp_path_factory):
    train("monitor.profile_steps=[2, 3]")
    traces = list(tmp_path_factory.getbasetemp().glob("options*/profile/rank0*.json*"))
    assert traces, "a torch.profiler trace of steps 2-3 for rank 0"
