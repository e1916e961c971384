"""Training options change how the work is done, not the numbers: activation checkpointing and
torch.compile give the fp32 losses of the plain run; bf16 stays within bf16 rounding of them."""

import pytest
import yaml

from llmtune.config import load_config
from llmtune.parallel import ParallelState
from llmtune.worker import build_trainer
from tests.helpers import read_metrics


@pytest.fixture(scope="module")
def train(tiny_model, sft_file, tmp_path_factory):
    def losses(*overrides: str) -> list[float]:
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
        finally:
            state.close()
        return [m["loss"] for m in read_metrics(root)]
    return losses


@pytest.fixture(scope="module")
def plain(train):
    return train()


@pytest.mark.parametrize("option", ["train.gradient_checkpointing=true", "train.compile=true"])
def test_option_gives_the_same_losses(train, plain, option):
    assert train(option) == pytest.approx(plain, rel=1e-5)


def test_bf16_stays_within_bf16_rounding(train, plain):
    bf16 = train("train.bf16=true")
    assert bf16 == pytest.approx(plain, rel=2e-2)
    assert bf16 != plain
