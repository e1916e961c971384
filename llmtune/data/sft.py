"""sft: canonical samples -> input_ids and labels, with the over-long policy applied."""

import datasets

from llmtune.data.templates import LabelRules, encode_sample
from llmtune.model.loss import IGNORE_INDEX

KEPT, TRUNCATED, TOO_LONG, NO_LABELS = 0, 1, 2, 3


def fit_length(input_ids: list[int], labels: list[int], max_seq_len: int, truncation: str) -> tuple[int, list, list]:
    """(status, input_ids, labels). `truncate_prompt` cuts tokens from the left (the oldest context)
    as long as the whole last response survives; otherwise, or with `drop`, the sample is dropped."""
    if len(input_ids) > max_seq_len:
        cut = len(input_ids) - max_seq_len
        if truncation == "drop" or _last_response_start(labels) < cut:
            return TOO_LONG, [], []
        # The cut also drops labels that lived in the removed context: only the kept turns train.
        input_ids, labels, status = input_ids[cut:], labels[cut:], TRUNCATED
    else:
        status = KEPT
    if all(label == IGNORE_INDEX for label in labels[1:]):
        return NO_LABELS, [], []
    return status, input_ids, labels


def _last_response_start(labels: list[int]) -> int:
    """Index where the last run of trained tokens begins (-1 when nothing is trained)."""
    end = max((i for i, label in enumerate(labels) if label != IGNORE_INDEX), default=-1)
    start = end
    while start > 0 and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    return start


def tokenize_examples(rows: datasets.Dataset, tokenizer, data_cfg, map_kw: dict, source: str) -> datasets.Dataset:
    """Canonical rows ({"sample"} or pre-tokenized {"input_ids", "labels"}) of `source` -> input_ids, labels,
    status."""
    rules = LabelRules.of(data_cfg, tokenizer)

    def encode(row, index):
        if "sample" in row:
            input_ids, labels = encode_sample(tokenizer, row["sample"], rules, f"{source}: row {index + 1}")
        else:
            input_ids, labels = row["input_ids"], row["labels"]
        status, input_ids, labels = fit_length(input_ids, labels, data_cfg.max_seq_len, data_cfg.truncation)
        return {"input_ids": input_ids, "labels": labels, "status": status}

    return rows.map(encode, with_indices=True, **map_kw).select_columns(["input_ids", "labels", "status"])
