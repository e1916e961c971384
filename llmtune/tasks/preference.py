"""dpo: preference pairs, the policy's log-probabilities of the chosen and the rejected response against a reference
model's (tasks/reference.py), every loss of dpo.loss_type (tasks/preference_losses.py).

A micro-batch holds whole pairs, each as two sequences in a row (chosen, then rejected; several pairs packed into
a row), numbered in turn by the collator. The step's loss, for any layout of its pairs over micro-batches and ranks:

    sum over its pairs of the pair loss / its pairs
    + (dpo.sft_weight + orpo's weight) x the chosen tokens' NLL / its chosen tokens
    + the features' terms (a router's load-balancing loss) / its labelled tokens

Under context parallelism each cp peer holds a slice of every sequence: the per-sequence sums are added over the
peers before the pair loss, which is not linear in them. Every peer then computes the same pair losses; each counts
1/cp of them, and its gradient flows through its own slice only, scaled by cp (`whole_sums`), so that over the peers
the value is counted once and the gradient is exactly that of the whole sequences.
"""

import torch

from llmtune.model.loss import IGNORE_INDEX
from llmtune.tasks.objective import Objective, Terms
from llmtune.tasks.precompute import Precompute
from llmtune.tasks.preference_losses import PairLogps, metric_sums, pair_losses
from llmtune.tasks.reference import build_reference, sequence_count

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def disable_dropout(hf_model) -> None:
    """Dropout off in the policy, as in the reference (TRL's disable_dropout): the nn.Dropout modules (peft's
    included) and the attention's own dropout probability."""
    for module in hf_model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def whole_sums(local: torch.Tensor, state) -> torch.Tensor:
    """Per-sequence sums over the cp peers' slices: the value of the whole sequences, and a gradient that reaches this
    rank's slice scaled by cp (the caller counts 1/cp of what it computes from them)."""
    if state.cp_size == 1:
        return local
    scaled = local * state.cp_size
    return scaled - (scaled - state.cp_sum(local)).detach()


def preference_parts(config, local, model_config, model, features, state):
    """(the reference, the precompute hook or None) of a preference task's run, after the policy's dropout is turned
    off where the recipe says so."""
    preference = config.preference()
    if preference.disable_dropout:
        disable_dropout(model.hf_model)
    if not preference.needs_reference():
        return None, None
    precompute = Precompute(config, local, model_config, features, state) \
        if preference.reference == "precomputed" else None
    return build_reference(config, local, model_config, model, features, state), precompute


def pairs(logps: torch.Tensor, tokens: torch.Tensor) -> PairLogps:
    """Per-sequence sums and labelled tokens -> chosen and rejected of each pair (even and odd sequences)."""
    return PairLogps(logps[0::2], logps[1::2], tokens[0::2], tokens[1::2])


class DPO(Objective):
    counts = ("pairs", "chosen_tokens")
    divisors = ("pairs", "chosen_tokens", "label_tokens")
    metrics = tuple((name, "pairs") for name in METRICS)
    samples = unit = "pairs"

    def __init__(self, dpo_cfg, reference, state, precompute=None):
        self.cfg, self.reference, self.state, self.precompute = dpo_cfg, reference, state, precompute
        weights = dpo_cfg.loss_weights or [1.0] * len(dpo_cfg.loss_type)
        # ORPO's loss is its odds-ratio term plus the chosen responses' NLL, both at its weight.
        self.nll_weight = dpo_cfg.sft_weight + sum(w for loss, w in zip(dpo_cfg.loss_type, weights) if loss == "orpo")

    @classmethod
    def build(cls, config, local, model_config, model, features, state, **parts) -> "DPO":
        reference, precompute = preference_parts(config, local, model_config, model, features, state)
        return cls(config.dpo, reference, state, precompute)

    def annotate(self, splits: dict, collate) -> dict:
        """dpo.reference: precomputed: the reference's log-probabilities added to every row, once."""
        if self.precompute is None:
            return splits
        splits, self.precompute = self.precompute(splits, collate), None
        return splits

    def count(self, inputs: dict, batch, cp_rank: int) -> list[float]:
        ids, labels = inputs["sequence_ids"], inputs["shift_labels"]
        chosen = (ids >= 0) & (ids % 2 == 0) & (labels != IGNORE_INDEX)
        return [sequence_count(batch) / 2 * (cp_rank == 0), float(chosen.sum())]

    def terms(self, model, inputs: dict, batch) -> Terms:
        local, tokens, features_terms = model.sequence_logps(**inputs, sequences=sequence_count(batch))
        tokens = self.state.cp_sum(tokens)
        policy = pairs(whole_sums(local, self.state), tokens)
        reference = None if self.reference is None else pairs(self.reference.logps(inputs, batch), tokens)
        pair_loss = pair_losses(policy, reference, self.cfg).sum() / self.state.cp_size
        chosen_nll = -local[0::2].sum()
        loss = torch.stack([pair_loss, self.nll_weight * chosen_nll, features_terms.reshape(())])
        sums = metric_sums(policy, reference, self.cfg.beta)
        once = float(self.state.cp_rank == 0)
        return Terms(loss, torch.stack([sums[name] for name in METRICS]).to(loss.device) * once)
