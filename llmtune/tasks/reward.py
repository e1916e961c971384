"""rm: a reward model, the model's family's sequence classifier with one label (model/build.py), trained on the
preference pairs dpo reads, in the same rows: a pair's chosen then rejected sequence, several pairs packed into a
row. Each sequence's score is the score head at its last token that is not padding (data/collate.score_marks), where
transformers' classifier reads it, so that the export scores a sequence as the run did. The step's loss, for any
layout of its pairs over micro-batches and ranks (TRL's RewardTrainer, its mean over a micro-batch made the step's):

    sum over its pairs of -log sigmoid(r_chosen - r_rejected - margin)
        + center_rewards_coefficient x (r_chosen + r_rejected)^2, over its pairs
    + the features' terms (a router's load-balancing loss) / its labelled tokens

margin: the pair's `margin` column where the data has one (TRL's), else 0 (data/formats.MARGIN). Under context parallelism each peer
holds the score of the sequences whose last token is in its slice: the peers' scores are added (preference.py's
whole_sums) before the loss, which every peer computes and counts 1/cp of.
"""

import torch
import torch.nn.functional as F

from llmtune.data.formats import MARGIN
from llmtune.model.loss import model_inputs
from llmtune.tasks.objective import Objective, Terms
from llmtune.tasks.preference import disable_dropout, whole_sums
from llmtune.tasks.reference import sequence_count

METRICS = ("accuracy", "margin", "rewards/chosen", "rewards/rejected")


def pair_terms(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor,
               center_coefficient: float | None) -> torch.Tensor:
    """Each pair's loss: -log sigmoid(chosen - rejected - margin), plus the centring term where its coefficient is
    set (TRL's center_rewards_coefficient, None: none)."""
    losses = -F.logsigmoid(chosen - rejected - margin)
    if center_coefficient is not None:
        losses = losses + center_coefficient * (chosen + rejected) ** 2
    return losses


def metric_sums(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Sums over the pairs of METRICS: accuracy (the chosen response scored higher; a tie counts half), the margin
    and each side's reward, detached."""
    chosen, rejected = chosen.detach(), rejected.detach()
    won = (chosen > rejected).double() + 0.5 * (chosen == rejected).double()
    return torch.stack([won.sum(), (chosen - rejected).double().sum(), chosen.double().sum(),
                        rejected.double().sum()])


class RM(Objective):
    counts = ("pairs",)
    divisors = ("pairs", "label_tokens")
    metrics = tuple((name, "pairs") for name in METRICS)
    samples = unit = "pairs"
    shown = ("accuracy", "margin")

    def __init__(self, rm_cfg, state, shares_prefixes: bool):
        self.cfg, self.state, self.shares_prefixes = rm_cfg, state, shares_prefixes

    @classmethod
    def build(cls, config, model, state, features, **parts) -> "RM":
        if config.rm.disable_dropout:
            disable_dropout(model.hf_model)
        # A score reads each sequence's last token alone: a pair's rejected sequence may leave the prompt it shares
        # with its chosen one to the chosen's tokens (data/collate.share_prefix), computed once.
        return cls(config.rm, state, features.keep_shared_prefixes())

    def count(self, inputs: dict, batch, cp_rank: int) -> list[float]:
        return [sequence_count(batch) / 2 * (cp_rank == 0)]

    def terms(self, model, inputs: dict, batch) -> Terms:
        local, features_terms = model.sequence_scores(**model_inputs(inputs), scored=inputs["scored"],
                                                      sequences=sequence_count(batch))
        scores = whole_sums(local, self.state)
        chosen, rejected = scores[0::2], scores[1::2]
        margin = batch.sequences[MARGIN][0::2].to(chosen)
        pair_loss = pair_terms(chosen, rejected, margin, self.cfg.center_rewards_coefficient).sum()
        loss = torch.stack([pair_loss / self.state.cp_size, features_terms.reshape(())])
        once = float(self.state.cp_rank == 0)
        return Terms(loss, metric_sums(chosen, rejected).to(loss.device) * once)
