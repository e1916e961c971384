"""GRPO's numbers as pure functions: the rewards of a generation round and their group-normalized advantages, and
each completion token's clipped policy-gradient loss, KL term and clipping flags. The formulas are TRL's
GRPOTrainer's (1.16), so that a recipe moved from TRL trains the same objective; the objective (tasks/grpo.py)
computes the log-probabilities and sums these over the optimizer step.

How the per-token losses become the step's loss is where llmtune departs from TRL on purpose: every loss_type is a
sum of per-token terms, each weighted (`TOKEN_WEIGHTS`) and divided by a count of the whole optimizer step, over
every rank and micro-batch (`DIVISORS`), so the gradient does not depend on the layout. TRL divides grpo's, bnpo's and
dr_grpo's per micro-batch and by the accumulation steps, which gives another gradient when completions are laid out
over micro-batches differently (TRL #3021, #3938); bnpo and dapo, which differ in TRL only in whether the token count
is the micro-batch's or the accumulated batch's, are here the same loss.
"""

import torch
from torch import Tensor

# The count of the whole step that divides each loss_type's summed token terms.
DIVISORS = {"grpo": "completions", "dr_grpo": "completions", "bnpo": "label_tokens", "dapo": "label_tokens"}
# TRL adds this to the standard deviation it divides by.
STD_EPSILON = 1e-4


def nanstd(values: Tensor, dim: int | None = None) -> Tensor:
    """The sample standard deviation (Bessel's correction) of the values that are not NaN, as TRL's nanstd."""
    mean = values.nanmean(dim=dim, keepdim=True)
    count = (~values.isnan()).sum(dim=dim, keepdim=True)
    variance = ((values - mean) ** 2).nanmean(dim=dim, keepdim=True) * count / (count - 1)
    return variance.sqrt() if dim is None else variance.sqrt().squeeze(dim)


def combined_rewards(per_function: Tensor, weights: Tensor) -> Tensor:
    """Each completion's reward from its reward functions' values [n, k] (NaN where a function returned None): the
    weighted sum of the values it has, NaN where it has none (TRL: unscorable, left out of the group's statistics and
    given advantage 0)."""
    rewards = (per_function * weights).nansum(dim=1)
    return rewards.masked_fill(per_function.isnan().all(dim=1), float("nan"))


def advantages(rewards: Tensor, num_generations: int, scale_rewards: str) -> tuple[Tensor, Tensor]:
    """(the advantage of each completion, whether its group's (scale_rewards: batch: the round's) standard deviation
    is zero) from the rewards [n] of a round, n = prompts x num_generations, each prompt's completions consecutive.

    advantage = reward - its group's mean, divided by (std + 1e-4) unless scale_rewards is none (Dr. GRPO); std is the
    group's or, for batch, the whole round's. A group whose rewards are all equal gets advantage 0; an unscorable
    completion (NaN reward) too."""
    grouped = rewards.view(-1, num_generations)
    centred = (grouped - grouped.nanmean(dim=1, keepdim=True)).view(-1)
    std = nanstd(rewards).expand_as(rewards) if scale_rewards == "batch" \
        else nanstd(grouped, dim=1).repeat_interleave(num_generations)
    scaled = centred if scale_rewards == "none" else centred / (std + STD_EPSILON)
    return scaled.nan_to_num(nan=0.0), torch.isclose(std, torch.zeros_like(std))


def k3_kl(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """Schulman's k3 estimate of KL(policy || reference) per token, as TRL's: exp(ref - pi) - (ref - pi) - 1."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def token_losses(log_weights: Tensor, advantages: Tensor, epsilon_low: float, epsilon_high: float
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """(each token's clipped surrogate loss -min(w A, clip(w, 1 - eps_low, 1 + eps_high) A), whether its ratio was
    clipped below, whether above), from its log importance weight (token level: log pi - log pi_old; sequence level,
    GSPO: its completion's mean of those) and its completion's advantage. A ratio counts as clipped where the clip
    changed the loss: below 1 - eps_low with a negative advantage, above 1 + eps_high with a positive one."""
    ratio = torch.exp(log_weights)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    losses = -torch.min(ratio * advantages, clipped * advantages)
    return losses, (ratio < 1 - epsilon_low) & (advantages < 0), (ratio > 1 + epsilon_high) & (advantages > 0)


def token_weights(loss_type: str, completion_lengths: Tensor, max_completion_length: int) -> Tensor:
    """The factor of each token's loss before the sum over the step that DIVISORS[loss_type] divides, from the length
    of the token's completion: grpo: 1 / that length (each completion's mean, then the mean over completions);
    dr_grpo: 1 / max_completion_length (a constant, Dr. GRPO); bnpo and dapo: 1 (the mean over every token)."""
    if loss_type == "grpo":
        return 1.0 / completion_lengths.clamp(min=1)
    if loss_type == "dr_grpo":
        return torch.full_like(completion_lengths, 1.0 / max_completion_length, dtype=torch.float32)
    return torch.ones_like(completion_lengths, dtype=torch.float32)
