"""GRPO's pure formulas against hand computations with the math module (float64, relative 1e-9 unless said): the
rewards of several functions weighted (None as NaN, an unscorable completion), the advantages for each scale_rewards
with a zero-variance group and an unscorable completion, the clipped surrogate and its clipping flags on both sides,
the k3 KL, and the token weights of each loss_type."""

import math

import pytest
import torch

from llmtune.config import GRPO_LOSSES
from llmtune.tasks.grpo_losses import (DIVISORS, STD_EPSILON, advantages, combined_rewards, k3_kl,
                                       nanstd, token_losses, token_weights)

NAN = float("nan")


def close(actual: torch.Tensor, expected: list[float], rel: float = 1e-9) -> None:
    assert actual.tolist() == pytest.approx(expected, rel=rel, abs=1e-12)


def test_rewards_are_the_weighted_sum_of_the_values_given_and_nan_where_none_is():
    per_function = torch.tensor([[1.0, NAN], [NAN, NAN], [0.5, 2.0]], dtype=torch.float64)
    rewards = combined_rewards(per_function, torch.tensor([1.0, 0.5], dtype=torch.float64))
    assert rewards[0] == 1.0 and math.isnan(rewards[1]) and rewards[2] == 0.5 + 0.5 * 2.0


def test_nanstd_is_the_sample_standard_deviation_of_the_values_given():
    values = torch.tensor([1.0, 0.0, NAN, 4.0], dtype=torch.float64)
    mean = 5.0 / 3
    expected = math.sqrt(((1 - mean) ** 2 + mean ** 2 + (4 - mean) ** 2) / 2)
    assert nanstd(values).item() == pytest.approx(expected, rel=1e-12)


def test_group_advantages_with_a_zero_variance_group():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    adv, zero_std = advantages(rewards, num_generations=2, scale_rewards="group")
    std = math.sqrt(0.5 ** 2 * 2 / 1)  # the first group's sample std
    close(adv, [0.5 / (std + STD_EPSILON), -0.5 / (std + STD_EPSILON), 0.0, 0.0])
    assert zero_std.tolist() == [False, False, True, True]


def test_batch_advantages_divide_by_the_whole_rounds_std():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    adv, zero_std = advantages(rewards, num_generations=2, scale_rewards="batch")
    std = math.sqrt((3 * 0.25 ** 2 + 0.75 ** 2) / 3)  # 0.5: the sample std of the four rewards
    close(adv, [0.5 / (std + STD_EPSILON), -0.5 / (std + STD_EPSILON), 0.0, 0.0])
    assert zero_std.tolist() == [False] * 4


def test_unscaled_advantages_are_centred_rewards_dr_grpo():
    rewards = torch.tensor([3.0, 1.0, 0.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    adv, zero_std = advantages(rewards, num_generations=3, scale_rewards="none")
    close(adv, [3 - 4 / 3, 1 - 4 / 3, -4 / 3, 0.0, 0.0, 0.0])
    assert zero_std.tolist() == [False] * 3 + [True] * 3


def test_an_unscorable_completion_gets_advantage_zero_and_is_left_out_of_its_groups_mean():
    rewards = torch.tensor([NAN, 1.0, 3.0, 1.0, 0.0, 2.0], dtype=torch.float64)
    adv, _ = advantages(rewards, num_generations=3, scale_rewards="none")
    close(adv, [0.0, 1 - 2.0, 3 - 2.0, 0.0, -1.0, 1.0])


def test_the_clipped_surrogate_and_its_flags():
    ratios = [1.5, 0.5, 1.0, 1.1, 0.5, 1.5]
    adv = torch.tensor([1.0, -1.0, 2.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    losses, low, high = token_losses(torch.tensor(ratios, dtype=torch.float64).log(), adv, 0.2, 0.28)
    # 1.5 A=1: clipped to 1.28; 0.5 A=-1: clipped to 0.8, -min(-0.5, -0.8) = 0.8; 1.0 A=2: -2; 1.1 A=-1 inside the
    # range: 1.1; 0.5 A=+1: the unclipped 0.5 is the smaller, -0.5, not a clip; 1.5 A=-1: -min(-1.5, -1.28) = 1.5.
    close(losses, [-1.28, 0.8, -2.0, 1.1, -0.5, 1.5], rel=1e-12)
    assert low.tolist() == [False, True, False, False, False, False]
    assert high.tolist() == [True, False, False, False, False, False]


def test_the_surrogates_gradient_is_the_advantage_where_the_ratio_is_one_and_zero_where_clipped():
    log_weights = torch.tensor([0.0, math.log(1.5), math.log(0.5)], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([0.7, 1.0, -1.0], dtype=torch.float64)
    losses, _, _ = token_losses(log_weights, adv, 0.2, 0.2)
    losses.sum().backward()
    close(log_weights.grad, [-0.7, 0.0, 0.0], rel=1e-12)


def test_k3_kl():
    logps = torch.tensor([math.log(0.5), math.log(0.2)], dtype=torch.float64)
    ref = torch.tensor([math.log(0.25), math.log(0.2)], dtype=torch.float64)
    close(k3_kl(logps, ref), [0.5 - math.log(0.5) - 1, 0.0])


@pytest.mark.parametrize("loss_type", GRPO_LOSSES)
def test_token_weights(loss_type):
    weights = token_weights(loss_type, torch.tensor([2, 4, 0]), max_completion_length=8)
    expected = {"grpo": [0.5, 0.25, 1.0], "dr_grpo": [0.125] * 3, "bnpo": [1.0] * 3, "dapo": [1.0] * 3}[loss_type]
    close(weights, expected, rel=1e-7)
    assert DIVISORS[loss_type] == ("completions" if loss_type in ("grpo", "dr_grpo") else "label_tokens")
