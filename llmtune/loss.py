"""Token cross-entropy as a SUM over the labelled tokens: the trainer divides by the global count."""

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Label of position t is the token at t+1; the last position has none.

    Shifting once, in the collator, lets token counting, the loss (and later sequence slicing)
    all see the same labels.
    """
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      shifted_labels: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), shifted_labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")
