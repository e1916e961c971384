"""Rows of token ids -> a padded micro-batch: input_ids, attention_mask, shift_labels."""

import torch

from llmtune.loss import IGNORE_INDEX, shift_labels


def collate(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row; pads are masked from attention and carry label -100.

    Rows without labels (pt blocks) are labelled with their own ids.
    """
    length = max(len(row["input_ids"]) for row in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        input_ids[i, :n] = torch.tensor(row["input_ids"])
        labels[i, :n] = torch.tensor(row.get("labels", row["input_ids"]))
        attention_mask[i, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "shift_labels": shift_labels(labels)}
