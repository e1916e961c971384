"""dpo: preference pairs, the policy's log-probabilities of the chosen and the rejected response against a reference
model's (tasks/reference.py), every loss of dpo.loss_type (tasks/preference_losses.py).

A micro-batch holds whole pairs, each as two sequences in a row (chosen, then rejected; several pairs packed into
a row). The step's loss, for any layout of its pairs over micro-batches and ranks:

    sum over its pairs of the pair loss / its pairs
    + (dpo.sft_weight + orpo's weight) x the chosen tokens' NLL / its chosen tokens
    + the features' terms (a router's load-balancing loss) / its labelled tokens

The pair losses are computed from whole sequences under context parallelism (tasks/preference.py's whole_sums).
"""

import torch

from llmtune.model.loss import IGNORE_INDEX
from llmtune.tasks.objective import Terms
from llmtune.tasks.preference import PreferenceObjective, whole_sums
from llmtune.tasks.preference_losses import PairLogps, metric_sums, pair_losses
from llmtune.tasks.reference import sequence_count

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def pairs(logps: torch.Tensor, tokens: torch.Tensor) -> PairLogps:
    """Per-sequence sums and labelled tokens -> chosen and rejected of each pair (even and odd sequences)."""
    return PairLogps(logps[0::2], logps[1::2], tokens[0::2], tokens[1::2])


class DPO(PreferenceObjective):
    counts = ("pairs", "chosen_tokens")
    divisors = ("pairs", "chosen_tokens", "label_tokens")
    metrics = tuple((name, "pairs") for name in METRICS)
    samples = unit = "pairs"
    shown = ("rewards/margins", "rewards/accuracies")

    def __init__(self, dpo_cfg, reference, state, precompute=None, shares_prefixes: bool = False):
        super().__init__(dpo_cfg, reference, state, precompute, shares_prefixes)
        weights = dpo_cfg.loss_weights or [1.0] * len(dpo_cfg.loss_type)
        # ORPO's loss is its odds-ratio term plus the chosen responses' NLL, both at its weight.
        self.nll_weight = dpo_cfg.sft_weight + sum(w for loss, w in zip(dpo_cfg.loss_type, weights) if loss == "orpo")

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
