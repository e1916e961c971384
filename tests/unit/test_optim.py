import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, get_scheduler

from llmtune.config import TrainConfig, load_config
from llmtune.training.optim import build_optimizer, build_scheduler, group_sizes
from tests.unit.test_config import write_recipe


def learning_rates(scheduler, steps: int) -> list[float]:
    rates = []
    for _ in range(steps):
        rates.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return rates


def optimizer() -> torch.optim.Optimizer:
    return torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1.0)


def recipe_rates(tmp_path, train: dict, steps: int = 12, rates: int = 12) -> list[float]:
    """The first `rates` learning rates of a run of `steps` optimizer steps."""
    train_cfg = load_config(write_recipe(tmp_path, train=train), [], "sft", 1).train
    return learning_rates(build_scheduler(optimizer(), train_cfg, steps), rates)


@pytest.mark.parametrize("kind, middle, last", [("constant", 1.0, 1.0), ("linear", 0.5, 0.0), ("cosine", 0.55, 0.1)])
def test_warmup_then_decay_to_the_minimum(tmp_path, kind, middle, last):
    rates = recipe_rates(tmp_path, {"lr_scheduler_type": kind, "warmup_steps": 2,
                                    "min_lr_ratio": 0.1 if kind == "cosine" else 0.0}, rates=13)
    assert rates[:3] == [0.0, 0.5, 1.0]
    assert rates[7] == pytest.approx(middle)
    assert rates[12] == pytest.approx(last)
    assert all(a >= b for a, b in zip(rates[2:], rates[3:])), "no increase after warm-up"


def test_warmup_stable_decay_holds_then_decays_over_its_last_steps(tmp_path):
    rates = recipe_rates(tmp_path, {"lr_scheduler_type": "wsd", "warmup_steps": 2, "decay_steps": 4,
                                    "decay_type": "linear", "min_lr_ratio": 0.1})
    assert rates[:3] == pytest.approx([0.1, 0.55, 1.0])  # transformers' WSD warms up from min_lr_ratio
    assert rates[3:8] == [1.0] * 5
    assert rates[8:] == pytest.approx([1.0, 0.775, 0.55, 0.325])


# HF name and lr_scheduler_kwargs as an HF Trainer user writes them -> transformers' own scheduler, step by step.
HF_SCHEDULES = [
    ("linear", {}),
    ("cosine", {}),
    ("constant_with_warmup", {}),
    ("cosine_with_min_lr", {"min_lr_rate": 0.1}),
    ("warmup_stable_decay", {"num_decay_steps": 4, "decay_type": "1-sqrt", "min_lr_ratio": 0.2}),
]


@pytest.mark.parametrize("name, kwargs", HF_SCHEDULES)
@pytest.mark.parametrize("warmup", [3, 0.25])
def test_hf_scheduler_names_give_transformers_learning_rates(tmp_path, name, kwargs, warmup):
    train = {"lr_scheduler_type": name, "warmup_steps": warmup, "lr_scheduler_kwargs": kwargs}
    theirs = get_scheduler(name, optimizer(), num_warmup_steps=3, num_training_steps=12,
                           scheduler_specific_kwargs=kwargs)
    assert recipe_rates(tmp_path, train) == pytest.approx(learning_rates(theirs, 12), rel=1e-12, abs=1e-15)


def test_no_decay_for_biases_and_norms_and_tied_weights_once():
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, tie_word_embeddings=True, attention_bias=True))
    optimizer = build_optimizer(model, TrainConfig(weight_decay=0.1))
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert optimizer.defaults["fused"]
    assert all(p.ndim >= 2 for p in decayed["params"]) and all(p.ndim == 1 for p in plain["params"])
    ids = [id(p) for group in optimizer.param_groups for p in group["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert sum(p is model.lm_head.weight for p in decayed["params"]) == 1
    # (tensors, elements): the tied embedding 32 x 8 once, q/k/v/o 8 x 8, gate/up/down 16 x 8 decayed; the four
    # attention biases of 8 and the three norms of 8 not.
    assert group_sizes(optimizer) == {"decay": (8, 32 * 8 + 4 * 8 * 8 + 3 * 16 * 8), "no_decay": (7, 7 * 8)}
