"""Token cross-entropy as a SUM over the labelled tokens: the trainer divides by the global count."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmtune.features.chunk_loss import chunked_cross_entropy_sum

IGNORE_INDEX = -100


@dataclass(frozen=True)
class LossOptions:
    """chunk_size 0 computes the full [tokens, vocab] logits (the reference, as HF models do);
    > 0 computes them that many tokens at a time. logit_softcap is the model config's
    final_logit_softcapping (Gemma); z_loss adds z_loss * logsumexp(logits)**2 per token;
    label_smoothing is F.cross_entropy's. The recipe's values are checked in config.py."""

    chunk_size: int = 0
    logit_softcap: float | None = None
    z_loss: float = 0.0
    label_smoothing: float = 0.0


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Label of position t is the token at t+1; the last position has none.

    Shifting once, in the collator, lets token counting, the loss (and later sequence slicing)
    all see the same labels.
    """
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      shifted_labels: torch.Tensor, options: LossOptions = LossOptions()) -> torch.Tensor:
    """fp32 sum of the per-token losses over the labels != IGNORE_INDEX; hidden [..., H], labels [...]."""
    hidden = hidden.reshape(-1, hidden.size(-1))
    shifted_labels = shifted_labels.reshape(-1)
    if options.chunk_size:
        return chunked_cross_entropy_sum(hidden, weight, bias, shifted_labels, options, IGNORE_INDEX)
    return _full_logits_cross_entropy_sum(hidden, weight, bias, shifted_labels, options)


def _full_logits_cross_entropy_sum(hidden, weight, bias, labels, options: LossOptions) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()
    if options.logit_softcap is not None:
        logits = options.logit_softcap * torch.tanh(logits / options.logit_softcap)
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum",
                           label_smoothing=options.label_smoothing)
    if options.z_loss:
        loss = loss + options.z_loss * torch.logsumexp(logits[labels != IGNORE_INDEX], dim=-1).square().sum()
    return loss
