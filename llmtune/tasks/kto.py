"""kto: unpaired examples, each a prompt with one completion labelled desirable or undesirable (KTO, Ethayarajh et
al. 2024, as TRL's KTOTrainer computes it).

A row holds whole examples, each as two sequences: prompt + its completion, then prompt + another example's
completion (data/preference.py builds the mismatched one), which estimates the reference point

    z0 = max(0, mean over the step's mismatched sequences of (policy - reference) log-probabilities)

without a gradient. TRL estimates it per micro-batch (gathered over the ranks); here it is the whole optimizer step's,
over every rank and micro-batch, so that it does not depend on how the examples are laid out: `begin` computes it
from forwards without gradients before the step's first loss (TRL runs that forward per micro-batch too), and keeps
the reference's values for the losses. With r = beta (policy - reference) of an example's completion:

    desirable: desirable_weight x (1 - sigmoid(r - beta z0));  undesirable: undesirable_weight x (1 - sigmoid(beta z0 - r))

summed over the step's examples and divided by their number (plus the features' terms over the labelled tokens).
"""

import torch

from llmtune.tasks.objective import Terms
from llmtune.tasks.preference import PreferenceObjective, whole_sums
from llmtune.tasks.reference import sequence_count

MARGINS = "rewards/margins"


def kto_losses(logratio: torch.Tensor, desirable: torch.Tensor, z0: torch.Tensor | float, cfg) -> torch.Tensor:
    """Each example's loss from its completion's log-ratio (policy - reference), its label (1.0 desirable, 0.0 not)
    and the reference point z0 (a scalar; KTO's value function, TRL's kto loss)."""
    reward, shift = cfg.beta * logratio, cfg.beta * z0
    return desirable * cfg.desirable_weight * (1 - torch.sigmoid(reward - shift)) \
        + (1 - desirable) * cfg.undesirable_weight * (1 - torch.sigmoid(shift - reward))


class KTO(PreferenceObjective):
    counts = ("examples", "desirable", "undesirable")
    divisors = ("examples", "label_tokens")
    # TRL's names: rewards and log-probabilities of the desirable (chosen) and undesirable (rejected) examples, and
    # kl, the reference point z0; summary adds the margin, as TRL's KTOTrainer logs it.
    metrics = (("rewards/chosen", "desirable"), ("rewards/rejected", "undesirable"), ("logps/chosen", "desirable"),
               ("logps/rejected", "undesirable"), ("kl", "examples"))
    samples = unit = "examples"
    shown = ("rewards/chosen", "rewards/rejected", "kl")

    def __init__(self, cfg, reference, state, precompute=None, shares_prefixes: bool = False):
        super().__init__(cfg, reference, state, precompute, shares_prefixes)
        self.z0 = torch.zeros((), dtype=torch.float64)
        self.references: list[torch.Tensor] = []  # the reference's values of the micro-batches `begin` saw, in order

    def metric_names(self) -> tuple[str, ...]:
        return (*super().metric_names(), MARGINS)

    def summary(self, sums: list[float], totals: list[float]) -> dict[str, float]:
        """Objective.summary, and TRL's rewards/margins: the desirable examples' mean reward less the undesirable
        ones', where the values had both."""
        values = super().summary(sums, totals)
        if "rewards/chosen" in values and "rewards/rejected" in values:
            values[MARGINS] = values["rewards/chosen"] - values["rewards/rejected"]
        return values

    def count(self, inputs: dict, batch, cp_rank: int) -> list[float]:
        desirable = float(batch.sequences["desirable"][0::2].sum())
        examples = sequence_count(batch) / 2
        return [examples * (cp_rank == 0), desirable * (cp_rank == 0), (examples - desirable) * (cp_rank == 0)]

    def begin(self, model, micro_batches) -> None:
        """z0 of the micro-batches (inputs, batch) of a step, or of a whole held-out split, over every rank."""
        totals = torch.zeros(2, dtype=torch.float64, device=self.state.device)
        self.references = []
        with torch.no_grad():
            for inputs, batch in micro_batches:
                local, _, _ = model.sequence_logps(**inputs, sequences=sequence_count(batch))
                reference = self.reference.logps(inputs, batch)
                self.references.append(reference)
                mismatched = (self.state.cp_sum(local) - reference)[1::2]
                totals += torch.stack([mismatched.double().sum(), torch.tensor(float(len(mismatched)))
                                       .to(totals)]) * (self.state.cp_rank == 0)
        kl_sum, count = self.state.all_reduce_sum(totals)
        # Kept on the device: the step reads it on the host with its other numbers, as the kl metric.
        self.z0 = (kl_sum / count.clamp(min=1.0)).clamp(min=0.0)

    def terms(self, model, inputs: dict, batch) -> Terms:
        local, _, features_terms = model.sequence_logps(**inputs, sequences=sequence_count(batch))
        policy, reference = whole_sums(local, self.state), self.references.pop(0)
        logratio = policy - reference
        desirable = batch.sequences["desirable"][0::2].to(logratio.dtype)
        losses = kto_losses(logratio[0::2], desirable, self.z0, self.cfg)
        loss = torch.stack([losses.sum() / self.state.cp_size, features_terms.reshape(())])
        with torch.no_grad():
            reward, chosen_logps = self.cfg.beta * logratio[0::2].double(), policy[0::2].double()
            sums = torch.stack([(reward * desirable).sum(), (reward * (1 - desirable)).sum(),
                                (chosen_logps * desirable).sum(), (chosen_logps * (1 - desirable)).sum(),
                                self.z0 * len(desirable)])
        return Terms(loss, sums * float(self.state.cp_rank == 0))
