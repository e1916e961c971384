"""The preference pair losses against their published formulas, computed by hand with the math module on made-up
log-probabilities (float64, relative 1e-6): each loss type, label smoothing, several losses weighted, the per-token
losses' dependence on the token counts, the loss and rewards when the policy is the reference, the DPO gradient,
the reference refused where a loss needs one, log(1 - exp(x)) where the naive formula loses its digits, and the
step's metric sums."""

import math

import pytest
import torch

from llmtune.config import DPOConfig
from llmtune.tasks.preference_losses import PairLogps, log1mexp, metric_sums, pair_losses, pair_rewards

BETA, GAMMA = 0.9, 0.5

# Per pair: policy's summed log-probs of chosen and rejected, their token counts, the reference's summed log-probs.
# The DPO margins h are 1.0, -1.5 and 1.25: the hinge is active, active and zero.
PAIRS = [
    dict(pi_c=-12.5, pi_r=-14.0, n_c=5, n_r=7, ref_c=-13.0, ref_r=-13.5),
    dict(pi_c=-30.0, pi_r=-26.5, n_c=12, n_r=10, ref_c=-29.0, ref_r=-27.0),
    dict(pi_c=-7.25, pi_r=-9.0, n_c=3, n_r=4, ref_c=-8.0, ref_r=-8.5),
]


def policy_logps(pairs, dtype=torch.float64) -> PairLogps:
    return PairLogps(torch.tensor([p["pi_c"] for p in pairs], dtype=dtype),
                     torch.tensor([p["pi_r"] for p in pairs], dtype=dtype),
                     torch.tensor([p["n_c"] for p in pairs]), torch.tensor([p["n_r"] for p in pairs]))


def reference_logps(pairs, dtype=torch.float64) -> PairLogps:
    return PairLogps(torch.tensor([p["ref_c"] for p in pairs], dtype=dtype),
                     torch.tensor([p["ref_r"] for p in pairs], dtype=dtype),
                     torch.tensor([p["n_c"] for p in pairs]), torch.tensor([p["n_r"] for p in pairs]))


def log_sigmoid(x: float) -> float:
    return math.log(1.0 / (1.0 + math.exp(-x)))


def margin(p) -> float:
    return (p["pi_c"] - p["ref_c"]) - (p["pi_r"] - p["ref_r"])


def hand_sigmoid(p, eps):
    return -(1 - eps) * log_sigmoid(BETA * margin(p)) - eps * log_sigmoid(-BETA * margin(p))


def hand_robust(p, eps):
    return (-(1 - eps) * log_sigmoid(BETA * margin(p)) + eps * log_sigmoid(-BETA * margin(p))) / (1 - 2 * eps)


def hand_hinge(p, eps):
    return max(0.0, 1 - BETA * margin(p))


def hand_ipo(p, eps):
    per_token = (p["pi_c"] / p["n_c"] - p["ref_c"] / p["n_c"]) - (p["pi_r"] / p["n_r"] - p["ref_r"] / p["n_r"])
    return (per_token - 1 / (2 * BETA)) ** 2


def hand_simpo(p, eps):
    m = BETA / p["n_c"] * p["pi_c"] - BETA / p["n_r"] * p["pi_r"] - GAMMA
    return -(1 - eps) * log_sigmoid(m) - eps * log_sigmoid(-m)


def hand_orpo(p, eps):
    def odds(average_logp):
        probability = math.exp(average_logp)
        return probability / (1 - probability)
    return -BETA * log_sigmoid(math.log(odds(p["pi_c"] / p["n_c"]) / odds(p["pi_r"] / p["n_r"])))


HAND = {"sigmoid": hand_sigmoid, "robust": hand_robust, "hinge": hand_hinge, "ipo": hand_ipo, "simpo": hand_simpo,
        "orpo": hand_orpo}


def config(loss_type, eps=0.0, weights=()) -> DPOConfig:
    return DPOConfig(beta=BETA, loss_type=list(loss_type), loss_weights=list(weights), label_smoothing=eps,
                     simpo_gamma=GAMMA)


def losses_of(loss_type, pairs=PAIRS, eps=0.0, weights=()) -> list[float]:
    return pair_losses(policy_logps(pairs), reference_logps(pairs), config(loss_type, eps, weights)).tolist()


@pytest.mark.parametrize("eps", [0.0, 0.2])
@pytest.mark.parametrize("loss", list(HAND))
def test_each_loss_is_its_published_formula_with_label_smoothing_where_it_has_one(loss, eps):
    assert losses_of([loss], eps=eps) == pytest.approx([HAND[loss](p, eps) for p in PAIRS], rel=1e-6)


def test_the_hinge_is_zero_past_its_margin_and_smoothing_changes_the_smoothed_losses():
    assert losses_of(["hinge"])[2] == 0.0 and losses_of(["hinge"])[:2] == pytest.approx([0.1, 2.35], rel=1e-6)
    for loss in ("sigmoid", "robust", "simpo"):
        assert all(abs(a - b) > 1e-3 for a, b in zip(losses_of([loss]), losses_of([loss], eps=0.2))), loss


def test_several_losses_add_up_weighted_and_one_each_without_weights():
    weighted = losses_of(["sigmoid", "ipo", "orpo"], weights=[0.5, 2.0, 0.1])
    assert weighted == pytest.approx([0.5 * hand_sigmoid(p, 0) + 2.0 * hand_ipo(p, 0) + 0.1 * hand_orpo(p, 0)
                                      for p in PAIRS], rel=1e-6)
    assert losses_of(["sigmoid", "simpo"], eps=0.1) == pytest.approx(
        [hand_sigmoid(p, 0.1) + hand_simpo(p, 0.1) for p in PAIRS], rel=1e-6)


def test_ipo_and_simpo_follow_the_token_counts_and_the_summed_losses_do_not():
    longer = [dict(PAIRS[0], n_c=10), dict(PAIRS[1], n_r=20), PAIRS[2]]  # the same sums over twice the tokens
    for loss in ("ipo", "simpo"):
        assert losses_of([loss], longer) == pytest.approx([HAND[loss](p, 0) for p in longer], rel=1e-6)
        changed = [abs(a - b) > 1e-3 for a, b in zip(losses_of([loss], longer), losses_of([loss]))]
        assert changed == [True, True, False], loss
    for loss in ("sigmoid", "robust", "hinge"):
        assert losses_of([loss], longer) == losses_of([loss]), loss


def test_a_response_without_labelled_tokens_counts_one_token():
    empty = [dict(PAIRS[0], pi_c=0.0, ref_c=0.0, n_c=0)]
    one = [dict(PAIRS[0], pi_c=0.0, ref_c=0.0, n_c=1)]
    for loss in ("ipo", "simpo"):
        assert losses_of([loss], empty) == pytest.approx([HAND[loss](p, 0) for p in one], rel=1e-6)


@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_a_policy_equal_to_its_reference_has_loss_ln2_no_reward_and_chance_accuracy(eps):
    same = [dict(p, pi_c=p["ref_c"], pi_r=p["ref_r"]) for p in PAIRS]
    losses = losses_of(["sigmoid"], same, eps=eps)
    if eps == 0.0:
        assert losses == [math.log(2)] * len(same)
    assert losses == pytest.approx([math.log(2)] * len(same), rel=1e-15)
    chosen, rejected = pair_rewards(policy_logps(same), reference_logps(same), BETA)
    assert chosen.tolist() == rejected.tolist() == [0.0] * len(same)
    assert metric_sums(policy_logps(same), reference_logps(same), BETA)["rewards/accuracies"].item() == \
        0.5 * len(same), "a tie is half a pair ranked right"


@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_the_dpo_gradient_in_the_chosen_logp_is_the_analytic_one(eps):
    policy = policy_logps(PAIRS)
    policy.chosen.requires_grad_(True)
    pair_losses(policy, reference_logps(PAIRS), config(["sigmoid"], eps)).sum().backward()

    def sigmoid(x):
        return 1.0 / (1.0 + math.exp(-x))
    analytic = [-BETA * (1 - eps) * sigmoid(-BETA * margin(p)) + BETA * eps * sigmoid(BETA * margin(p))
                for p in PAIRS]
    assert policy.chosen.grad.tolist() == pytest.approx(analytic, rel=1e-6)


@pytest.mark.parametrize("loss_type", [["sigmoid"], ["robust"], ["hinge"], ["ipo"], ["simpo", "sigmoid"]])
def test_a_loss_with_a_reference_refuses_none(loss_type):
    with pytest.raises(ValueError, match="needs the reference"):
        pair_losses(policy_logps(PAIRS), None, config(loss_type))


@pytest.mark.parametrize("loss_type", [["simpo"], ["orpo"], ["simpo", "orpo"]])
def test_reference_free_losses_take_none_and_ignore_a_reference(loss_type):
    without = pair_losses(policy_logps(PAIRS), None, config(loss_type)).tolist()
    assert without == losses_of(loss_type)
    assert without == pytest.approx([sum(HAND[loss](p, 0) for loss in loss_type) for p in PAIRS], rel=1e-6)


def test_rewards_are_detached_log_ratios_or_without_a_reference_average_logps():
    policy = policy_logps(PAIRS)
    policy.chosen.requires_grad_(True)
    chosen, rejected = pair_rewards(policy, reference_logps(PAIRS), BETA)
    assert chosen.tolist() == pytest.approx([BETA * (p["pi_c"] - p["ref_c"]) for p in PAIRS], rel=1e-6)
    assert rejected.tolist() == pytest.approx([BETA * (p["pi_r"] - p["ref_r"]) for p in PAIRS], rel=1e-6)
    assert not chosen.requires_grad
    chosen, rejected = pair_rewards(policy, None, BETA)
    assert chosen.tolist() == pytest.approx([BETA * p["pi_c"] / p["n_c"] for p in PAIRS], rel=1e-6)
    assert rejected.tolist() == pytest.approx([BETA * p["pi_r"] / p["n_r"] for p in PAIRS], rel=1e-6)
    assert not chosen.requires_grad


@pytest.mark.parametrize("with_reference", [True, False])
def test_metric_sums_are_fp64_detached_sums_under_trls_names(with_reference):
    policy = policy_logps(PAIRS, torch.float32)
    policy.chosen.requires_grad_(True)
    reference = reference_logps(PAIRS, torch.float32) if with_reference else None
    sums = metric_sums(policy, reference, BETA)
    if with_reference:
        chosen = [BETA * (p["pi_c"] - p["ref_c"]) for p in PAIRS]
        rejected = [BETA * (p["pi_r"] - p["ref_r"]) for p in PAIRS]
        logps_chosen, logps_rejected = [p["pi_c"] for p in PAIRS], [p["pi_r"] for p in PAIRS]
    else:
        chosen = [BETA * p["pi_c"] / p["n_c"] for p in PAIRS]
        rejected = [BETA * p["pi_r"] / p["n_r"] for p in PAIRS]
        # TRL's CPO (simpo) and ORPO trainers log the per-token averages under logps/*, DPOTrainer the sums.
        logps_chosen = [p["pi_c"] / p["n_c"] for p in PAIRS]
        logps_rejected = [p["pi_r"] / p["n_r"] for p in PAIRS]
    expected = {
        "rewards/chosen": sum(chosen),
        "rewards/rejected": sum(rejected),
        "rewards/accuracies": sum(c > r for c, r in zip(chosen, rejected)),
        "rewards/margins": sum(c - r for c, r in zip(chosen, rejected)),
        "logps/chosen": sum(logps_chosen),
        "logps/rejected": sum(logps_rejected),
    }
    assert set(sums) == set(expected)
    for name, value in sums.items():
        assert value.dtype == torch.float64 and value.dim() == 0 and not value.requires_grad, name
        assert value.item() == pytest.approx(expected[name], rel=1e-6), name
    assert sums["rewards/accuracies"].item() == (2 if with_reference else 1)


def test_log1mexp_keeps_its_digits_near_zero_and_far_below():
    near, far = -1e-10, -50.0
    values = log1mexp(torch.tensor([near, -0.5, far], dtype=torch.float64)).tolist()
    # series: log(1 - e^x) = log(-x) + x/2 + ... near 0, and -e^x - e^(2x)/2 - ... far below
    expected = [math.log(-near) + near / 2, math.log(1 - math.exp(-0.5)), -math.exp(far) - math.exp(2 * far) / 2]
    assert values == pytest.approx(expected, rel=1e-12)
    x = -1e-6  # in fp32, 1 - exp(x) alone keeps two digits here
    assert log1mexp(torch.tensor([x])).item() == pytest.approx(math.log(-x) + x / 2, rel=1e-6)
