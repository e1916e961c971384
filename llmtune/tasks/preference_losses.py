"""The pair losses of preference training (DPO and its kin), their rewards and the step's metric sums.

Pure functions of each pair's summed log-probabilities and labelled-token counts, under the policy and (for the
losses that have one) the reference: the objective (tasks/preference.py) computes those, averages the losses over
the step's pairs and adds the NLL terms (dpo.sft_weight, ORPO's NLL on the chosen responses). The formulas follow
TRL's, so that a recipe moved from TRL trains the same objective.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class PairLogps:
    """One entry per pair (fp32 or fp64 tensors [P]): the log-probabilities summed over each response's labelled
    tokens, and how many tokens those are (for the losses that average per token)."""
    chosen: Tensor
    rejected: Tensor
    chosen_tokens: Tensor
    rejected_tokens: Tensor

    def averages(self) -> tuple[Tensor, Tensor]:
        """The per-token average log-probabilities of (chosen, rejected). A response with no labelled token (cut away
        entirely) counts one, so that its average is its sum, 0, rather than 0 / 0."""
        return (self.chosen / self.chosen_tokens.clamp(min=1),
                self.rejected / self.rejected_tokens.clamp(min=1))


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x <= 0, accurate over the whole range (Maechler 2012): near 0, 1 - exp(x) cancels and
    -expm1(x) keeps its digits; far below, exp(x) is tiny and log1p keeps them."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _logratio_margin(policy: PairLogps, reference: PairLogps) -> Tensor:
    """h = (pi_c - ref_c) - (pi_r - ref_r): how much more the policy prefers the chosen response than the reference
    does, in summed log-probabilities."""
    return (policy.chosen - reference.chosen) - (policy.rejected - reference.rejected)


def _average_logratio_margin(policy: PairLogps, reference: PairLogps) -> Tensor:
    """h of the per-token average log-probabilities, both models' (IPO's, as TRL divides every summed log-prob)."""
    (pi_c, pi_r), (ref_c, ref_r) = policy.averages(), reference.averages()
    return (pi_c - ref_c) - (pi_r - ref_r)


def _smoothed_logistic_loss(x: Tensor, eps: float) -> Tensor:
    """-log sigmoid(x), with the preference flipped with probability eps (cDPO's label smoothing)."""
    return -(1 - eps) * F.logsigmoid(x) - eps * F.logsigmoid(-x)


def _sigmoid(policy: PairLogps, reference: PairLogps, cfg) -> Tensor:
    """DPO (Rafailov et al. 2023); cDPO with dpo.label_smoothing."""
    return _smoothed_logistic_loss(cfg.beta * _logratio_margin(policy, reference), cfg.label_smoothing)


def _robust(policy: PairLogps, reference: PairLogps, cfg) -> Tensor:
    """Robust DPO (Chowdhury et al. 2024): an unbiased estimate of the clean loss under flip rate eps."""
    logits, eps = cfg.beta * _logratio_margin(policy, reference), cfg.label_smoothing
    return (-(1 - eps) * F.logsigmoid(logits) + eps * F.logsigmoid(-logits)) / (1 - 2 * eps)


def _hinge(policy: PairLogps, reference: PairLogps, cfg) -> Tensor:
    """SLiC's hinge (Zhao et al. 2023) on the DPO margin."""
    return torch.relu(1 - cfg.beta * _logratio_margin(policy, reference))


def _ipo(policy: PairLogps, reference: PairLogps, cfg) -> Tensor:
    """IPO (Azar et al. 2023) on per-token averages, as its authors confirmed: the squared distance of the margin from
    1 / (2 beta), which bounds the margin where DPO's loss keeps pushing it."""
    return (_average_logratio_margin(policy, reference) - 1 / (2 * cfg.beta)) ** 2


def _simpo(policy: PairLogps, reference: PairLogps | None, cfg) -> Tensor:
    """SimPO (Meng et al. 2024): no reference; the reward is beta x the average log-prob, its margin offset by
    simpo_gamma; label smoothing as TRL's CPO trainer."""
    average_chosen, average_rejected = policy.averages()
    margin = cfg.beta * (average_chosen - average_rejected) - cfg.simpo_gamma
    return _smoothed_logistic_loss(margin, cfg.label_smoothing)


def _orpo(policy: PairLogps, reference: PairLogps | None, cfg) -> Tensor:
    """ORPO's odds-ratio term (Hong et al. 2024), weighted by beta (the paper's lambda, as TRL's). No reference. The
    NLL on the chosen responses, ORPO's other half, is the objective's (added over the step's chosen tokens)."""
    average_chosen, average_rejected = policy.averages()
    log_odds = (average_chosen - average_rejected) - (log1mexp(average_chosen) - log1mexp(average_rejected))
    return -cfg.beta * F.logsigmoid(log_odds)


PAIR_LOSSES = {"sigmoid": _sigmoid, "robust": _robust, "hinge": _hinge, "ipo": _ipo, "simpo": _simpo,
               "orpo": _orpo}


def pair_losses(policy: PairLogps, reference: PairLogps | None, dpo_cfg) -> Tensor:
    """Each pair's loss [P], differentiable: sum over dpo_cfg.loss_type of its weight (dpo_cfg.loss_weights, 1 each
    when empty) x that loss. `reference` is None only when every loss needs none (simpo, orpo)."""
    if reference is None and dpo_cfg.needs_reference():
        raise ValueError(f"dpo.loss_type {dpo_cfg.loss_type} needs the reference's log-probabilities; got none")
    weights = dpo_cfg.loss_weights or [1.0] * len(dpo_cfg.loss_type)
    return sum(weight * PAIR_LOSSES[name](policy, reference, dpo_cfg)
               for name, weight in zip(dpo_cfg.loss_type, weights, strict=True))


def pair_rewards(policy: PairLogps, reference: PairLogps | None, beta: float) -> tuple[Tensor, Tensor]:
    """The (chosen, rejected) rewards [P], detached: beta x the log-ratio to the reference (TRL's rewards/chosen and
    rewards/rejected), or without a reference beta x the average log-prob (TRL's CPO and ORPO rewards)."""
    with torch.no_grad():
        if reference is None:
            average_chosen, average_rejected = policy.averages()
            return beta * average_chosen, beta * average_rejected
        return beta * (policy.chosen - reference.chosen), beta * (policy.rejected - reference.rejected)


def metric_sums(policy: PairLogps, reference: PairLogps | None, beta: float) -> dict[str, Tensor]:
    """The step's metrics as fp64 scalar sums over these pairs, detached, under TRL's names: the caller adds them
    over micro-batches and ranks and divides by the global pair count, so every pair weighs the same however the
    pairs were split. A tie counts as half a pair ranked right (TRL counts it as none): a policy that is still its
    reference has accuracy 0.5, chance, rather than 0. logps/* are the summed log-probabilities (DPOTrainer's), or
    without a reference their per-token averages, as TRL's CPO (simpo) and ORPO trainers log them."""
    chosen, rejected = (reward.double() for reward in pair_rewards(policy, reference, beta))
    logps_chosen, logps_rejected = (policy.chosen, policy.rejected) if reference is not None else policy.averages()
    return {
        "rewards/chosen": chosen.sum(),
        "rewards/rejected": rejected.sum(),
        "rewards/accuracies": ((chosen > rejected).double() + 0.5 * (chosen == rejected).double()).sum(),
        "rewards/margins": (chosen - rejected).sum(),
        "logps/chosen": logps_chosen.detach().double().sum(),
        "logps/rejected": logps_rejected.detach().double().sum(),
    }
