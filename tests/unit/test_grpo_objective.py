"""grpo's objective on one hand-made micro-batch (two completions of one prompt packed in a row, the second
truncated), against its loss computed by hand with the math module (relative 1e-6): the row's labels and old
log-probabilities in line with the completions' tokens; every loss_type's weights with clipping below and above;
mask_truncated_completions leaving the truncated completion out; GSPO's ratio per completion; the KL term with and
without TRL's bias correction; the logged kl against TRL's formula in plain torch (ratios not 1); the gradient of an
unclipped token; and the step's counts."""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from llmtune.config import GRPO_LOSSES, GRPOConfig
from llmtune.model.loss import IGNORE_INDEX
from llmtune.tasks.grpo import GRPO, Round

PROMPT = [5, 6]
COMPLETIONS = [[7, 8, 9], [10, 11]]
OLD = [[-1.0, -2.0, -0.5], [-1.5, -0.7]]
NEW = [[-0.9, -2.3, -0.5], [-1.2, -0.9]]  # ratios e^0.1 (1.105), e^-0.3 (0.741: below 0.8), 1; e^0.3 (1.35), e^-0.2
REF = [[-1.1, -2.0, -0.4], [-1.0, -1.0]]
ADVANTAGES = [1.0, -1.0]
# Where each completion's tokens are labelled in the row [5 6 7 8 9 5 6 10 11] (position t: the label of token t + 1).
POSITIONS = [[1, 2, 3], [6, 7]]
EPSILON, EPSILON_HIGH, MAX_LENGTH, BETA = 0.2, 0.28, 4, 0.1


class FakeModel:
    """token_logps as the training model gives them: NEW at the labelled positions (a leaf that takes the
    gradient), 0 elsewhere."""

    def __init__(self, values):
        self.leaf = torch.tensor([v for completion in values for v in completion], requires_grad=True)

    def token_logps(self, shift_labels, sequence_ids, temperature, with_entropy=False, **inputs):
        assert "old_logps" not in inputs, "the objective's per-token values never reach the model"
        logps = torch.zeros(shift_labels.shape).index_put((torch.zeros(5, dtype=torch.long),
                                                          torch.tensor([p for ps in POSITIONS for p in ps])),
                                                         self.leaf)
        return logps, torch.zeros(shift_labels.shape) if with_entropy else None, torch.zeros(())


class FakeReference:
    def token_logps(self, inputs, temperature):
        return FakeModel(REF).token_logps(**inputs, temperature=temperature)[0].detach()


def objective(reference=False, **cfg) -> GRPO:
    config = GRPOConfig(reward_funcs=["accuracy"], num_generations=2, max_completion_length=MAX_LENGTH,
                        epsilon=EPSILON, epsilon_high=EPSILON_HIGH, **cfg)
    state = SimpleNamespace(dp_size=1, dp_rank=0, cp_size=1, cp_rank=0, is_main=True, device=torch.device("cpu"))
    tokenizer = SimpleNamespace(eos_token_id=2, pad_token_id=0)
    return GRPO(config, state, tokenizer, None, seed=0, output_dir=Path("unused"), batch_size=2, document_mask=True,
                logging_steps=1, reference=FakeReference() if reference else None)


def micro_batch(grpo: GRPO):
    found = Round(0, [[0, 0, COMPLETIONS[0], False], [0, 1, COMPLETIONS[1], True]], ADVANTAGES, [0, 1], {},
                  old={0: OLD[0], 1: OLD[1]})
    [batch], [indices] = grpo._layout([{"input_ids": PROMPT}], found, 0)
    assert indices == [0, 1]
    return batch


def clipped_loss(ratio: float, advantage: float) -> float:
    clipped = min(max(ratio, 1 - EPSILON), 1 + EPSILON_HIGH)
    return -min(ratio * advantage, clipped * advantage)


def test_the_row_holds_both_completions_labelled_with_their_old_log_probabilities():
    batch = micro_batch(objective())
    assert batch.inputs["input_ids"][0].tolist() == PROMPT + COMPLETIONS[0] + PROMPT + COMPLETIONS[1]
    labels = batch.inputs["shift_labels"][0].tolist()
    assert [labels[p] for ps in POSITIONS for p in ps] == COMPLETIONS[0] + COMPLETIONS[1]
    assert sum(label != IGNORE_INDEX for label in labels) == 5
    old = batch.inputs["old_logps"][0].tolist()
    assert [old[p] for ps in POSITIONS for p in ps] == pytest.approx(OLD[0] + OLD[1])
    assert batch.sequences["advantage"].tolist() == ADVANTAGES
    assert batch.sequences["loss_tokens"].tolist() == [3.0, 2.0]


@pytest.mark.parametrize("loss_type", GRPO_LOSSES)
def test_every_loss_type_sums_the_clipped_token_losses_with_its_weights(loss_type):
    grpo = objective(loss_type=loss_type)
    batch = micro_batch(grpo)
    terms = grpo.terms(FakeModel(NEW), batch.inputs, batch)
    weights = {"grpo": [1 / 3, 1 / 2], "dr_grpo": [1 / MAX_LENGTH] * 2, "bnpo": [1, 1], "dapo": [1, 1]}[loss_type]
    expected = sum(weights[s] * clipped_loss(math.exp(new - old), ADVANTAGES[s])
                   for s in range(2) for new, old in zip(NEW[s], OLD[s]))
    assert terms.loss[0].item() == pytest.approx(expected, rel=1e-6)
    # The clip changes no token's loss here: 0.741 < 0.8 has a positive advantage, 1.35 > 1.28 a negative one.
    assert terms.metrics.tolist()[1:] == [0.0, 0.0, 0.0]
    assert grpo.divisors[0] == ("completions" if loss_type in ("grpo", "dr_grpo") else "label_tokens")


def test_clipping_flags_count_the_tokens_whose_loss_the_clip_changed():
    grpo = objective()
    batch = micro_batch(grpo)
    batch.sequences["advantage"] = torch.tensor([-1.0, 1.0], dtype=torch.float64)  # flipped
    terms = grpo.terms(FakeModel(NEW), batch.inputs, batch)
    # Completion 0 (A = -1): 0.741 < 0.8 is clipped below; completion 1 (A = +1): 1.35 > 1.28 above.
    assert terms.metrics.tolist()[1:] == [1.0, 1.0, 2.0]
    expected = sum(clipped_loss(math.exp(new - old), advantage) for s, advantage in enumerate([-1.0, 1.0])
                   for new, old in zip(NEW[s], OLD[s]))
    assert terms.loss[0].item() == pytest.approx(expected, rel=1e-6)


def test_a_masked_truncated_completion_adds_nothing():
    grpo = objective(mask_truncated_completions=True)
    batch = micro_batch(grpo)
    labels = batch.inputs["shift_labels"][0].tolist()
    assert [labels[p] for p in POSITIONS[1]] == [IGNORE_INDEX] * 2
    assert batch.sequences["loss_tokens"].tolist() == [3.0, 0.0]
    inputs = {**batch.inputs, "labelled": None}
    counts = grpo.local_counts(inputs, batch, cp_rank=0)
    assert (counts[3], counts[0]) == (2.0, 3.0), "2 completions, 3 completion tokens (the labelled ones)"
    terms = grpo.terms(FakeModel(NEW), batch.inputs, batch)
    expected = sum(clipped_loss(math.exp(new - old), ADVANTAGES[0]) for new, old in zip(NEW[0], OLD[0]))
    assert terms.loss[0].item() == pytest.approx(expected, rel=1e-6)


def test_gspo_takes_one_ratio_per_completion():
    grpo = objective(importance_sampling_level="sequence", loss_type="grpo")
    batch = micro_batch(grpo)
    terms = grpo.terms(FakeModel(NEW), batch.inputs, batch)
    expected = 0.0
    for s in range(2):
        ratio = math.exp(sum(n - o for n, o in zip(NEW[s], OLD[s])) / len(NEW[s]))
        expected += clipped_loss(ratio, ADVANTAGES[s])  # grpo: the completion's mean of equal token losses
    assert terms.loss[0].item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("bias_correction", [True, False])
def test_the_kl_term_is_k3_against_the_reference_weighted_by_the_ratio(bias_correction):
    grpo = objective(reference=True, beta=BETA, use_bias_correction_kl=bias_correction)
    batch = micro_batch(grpo)
    terms = grpo.terms(FakeModel(NEW), batch.inputs, batch)
    expected, kl_sum = 0.0, 0.0
    for s in range(2):
        for new, old, ref in zip(NEW[s], OLD[s], REF[s]):
            kl = math.exp(ref - new) - (ref - new) - 1
            ratio = math.exp(new - old)
            expected += clipped_loss(ratio, ADVANTAGES[s]) + BETA * kl * (ratio if bias_correction else 1.0)
            kl_sum += kl * (ratio if bias_correction else 1.0)
    assert terms.loss[0].item() == pytest.approx(expected, rel=1e-6)
    assert terms.metrics[-1].item() == pytest.approx(kl_sum, rel=1e-6), "kl: the tokens' k3, times TRL's ratio"


def padded(values) -> torch.Tensor:
    """[completions, longest] fp32, 0 after a completion's end, as TRL holds its completions."""
    return torch.tensor([row + [0.0] * (3 - len(row)) for row in values])


def trl_kl(level: str, bias_correction: bool, mask: torch.Tensor) -> float:
    """TRL 1.16's logged kl, as its GRPOTrainer._compute_loss computes it for one process and micro-batch: the k3
    estimate times coef_1 (the unclipped ratio: per token, or the completion's exp(mean log-ratio)) where
    use_bias_correction_kl, its masked mean over every completion token (global_masked_mean)."""
    new, old, ref = padded(NEW), padded(OLD), padded(REF)
    log_ratio = new - old
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    per_token_kl = torch.exp(ref - new) - (ref - new) - 1
    if bias_correction:
        per_token_kl = per_token_kl * torch.exp(log_ratio)
    return ((per_token_kl * mask).sum() / mask.sum().clamp(min=1.0)).item()


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("mask_truncated", [False, True])
def test_the_logged_kl_is_trls_in_a_step_whose_ratios_are_not_1(level, bias_correction, mask_truncated):
    grpo = objective(reference=True, beta=BETA, use_bias_correction_kl=bias_correction,
                     importance_sampling_level=level, mask_truncated_completions=mask_truncated)
    batch = micro_batch(grpo)
    terms = grpo.terms(FakeModel(NEW), batch.inputs, batch)
    logged = grpo.summary(terms.loss.tolist() + terms.metrics.tolist(), grpo.local_counts(batch.inputs, batch, 0))
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0 if mask_truncated else 1.0, 0.0 if mask_truncated else 1.0, 0.0]])
    expected = trl_kl(level, bias_correction, mask)
    assert logged["kl"] == pytest.approx(expected, rel=1e-5, abs=1e-7 * abs(expected))


def test_an_unclipped_tokens_gradient_is_minus_its_advantage_times_its_ratio():
    grpo = objective()
    batch = micro_batch(grpo)
    model = FakeModel(NEW)
    grpo.terms(model, batch.inputs, batch).loss[0].backward()
    grads = model.leaf.grad.tolist()
    ratios = [math.exp(n - o) for s in range(2) for n, o in zip(NEW[s], OLD[s])]
    # Completion 0 (A = +1): 1.105 and 1 inside the range, 0.741 below it but not clipped (A > 0: the smaller term is
    # the unclipped one); completion 1 (A = -1): 1.35 is not clipped either (the larger loss is kept), e^-0.2 inside.
    expected = [-ratios[0], -ratios[1], -ratios[2], ratios[3], ratios[4]]
    assert grads == pytest.approx(expected, rel=1e-6)
