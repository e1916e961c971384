import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llmtune.config import TrainConfig
from llmtune.optim import build_optimizer, build_scheduler, lr_factor


@pytest.mark.parametrize("kind, middle", [("constant", 1.0), ("linear", 0.55), ("cosine", 0.55)])
def test_warmup_then_decay_to_the_minimum(kind, middle):
    factors = [lr_factor(step, 2, 12, kind, 0.1) for step in range(13)]
    assert factors[:3] == [0.0, 0.5, 1.0]
    assert factors[7] == pytest.approx(middle)
    assert factors[12] == pytest.approx(1.0 if kind == "constant" else 0.1)
    assert all(a >= b for a, b in zip(factors[2:], factors[3:])), "no increase after warm-up"


def test_scheduler_uses_warmup_ratio_or_steps():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    scheduler = build_scheduler(optimizer, TrainConfig(warmup_ratio=0.25, lr_scheduler_type="cosine"), 8)
    lrs = []
    for _ in range(8):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert lrs[:3] == [0.0, 0.5, 1.0]
    assert lrs[-1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 5 / 6)))


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
