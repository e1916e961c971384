"""KTO's loss per example equals the paper's value function (as TRL's kto loss computes it) on hand-computed
log-ratios, float64, relative 1e-12; at the reference (log-ratio 0, z0 0) every example's loss is exactly 1/2 of its
weight; gradients in the log-ratio are the analytic ones."""

import math

import pytest
import torch

from llmtune.config import KTOConfig
from llmtune.tasks.kto import kto_losses

EXAMPLES = [(0.8, 1.0), (-1.3, 1.0), (0.4, 0.0), (-2.5, 0.0)]  # (log-ratio, desirable)


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def by_hand(logratio: float, desirable: float, z0: float, cfg: KTOConfig) -> float:
    if desirable:
        return cfg.desirable_weight * (1 - sigmoid(cfg.beta * (logratio - z0)))
    return cfg.undesirable_weight * (1 - sigmoid(cfg.beta * (z0 - logratio)))


@pytest.mark.parametrize("z0", [0.0, 0.7])
@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 1.33)])
def test_each_example_follows_the_value_function(z0, weights):
    cfg = KTOConfig(beta=0.3, desirable_weight=weights[0], undesirable_weight=weights[1])
    logratio = torch.tensor([e[0] for e in EXAMPLES], dtype=torch.float64)
    desirable = torch.tensor([e[1] for e in EXAMPLES], dtype=torch.float64)
    got = kto_losses(logratio, desirable, z0, cfg).tolist()
    assert got == pytest.approx([by_hand(r, d, z0, cfg) for r, d in EXAMPLES], rel=1e-12)


def test_at_the_reference_every_loss_is_half_its_weight():
    cfg = KTOConfig(desirable_weight=1.0, undesirable_weight=2.0)
    losses = kto_losses(torch.zeros(4), torch.tensor([1.0, 0.0, 1.0, 0.0]), 0.0, cfg)
    assert losses.tolist() == [0.5, 1.0, 0.5, 1.0]


def test_the_gradient_is_the_analytic_one():
    cfg = KTOConfig(beta=0.5)
    logratio = torch.tensor([0.6, -0.2], dtype=torch.float64, requires_grad=True)
    kto_losses(logratio, torch.tensor([1.0, 0.0], dtype=torch.float64), 0.1, cfg).sum().backward()
    s_desirable, s_undesirable = sigmoid(0.5 * (0.6 - 0.1)), sigmoid(0.5 * (0.1 + 0.2))
    expected = [-0.5 * s_desirable * (1 - s_desirable), 0.5 * s_undesirable * (1 - s_undesirable)]
    assert logratio.grad.tolist() == pytest.approx(expected, rel=1e-12)
