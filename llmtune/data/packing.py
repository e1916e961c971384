"""Padding-free packing: several samples (sft) or documents (pt) per row, position_ids restarting at each.

The first token of each sample carries no label, so no label (after the shift) asks one sample to
predict the next. sft rows are filled first-fit-decreasing within windows of samples, deterministic
and independent of the number of ranks.
"""

import datasets

from llmtune.model.loss import IGNORE_INDEX

# Samples and documents are packed within windows of this many, so memory stays bounded; for pt
# what is left at the end of a window is dropped or kept as a shorter block (data.pt_remainder),
# a small fraction of the corpus.
PACK_WINDOW = 2000


def concatenate(samples) -> dict[str, list[int]]:
    """(input_ids, labels) pairs -> one packed sequence: input_ids, labels and position_ids."""
    packed: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}
    for input_ids, labels in samples:
        packed["input_ids"] += input_ids
        packed["labels"] += [IGNORE_INDEX] + labels[1:]
        packed["position_ids"] += range(len(input_ids))
    return packed


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of indices whose lengths sum to at most `capacity`."""
    bins: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[index] <= free:
                bins[b].append(index)
                room[b] -= lengths[index]
                break
        else:
            bins.append([index])
            room.append(capacity - lengths[index])
    return bins


def pack_samples(samples: datasets.Dataset, max_seq_len: int, map_kw: dict) -> datasets.Dataset:
    def pack(batch):
        rows = {"input_ids": [], "labels": [], "position_ids": []}
        for members in first_fit_decreasing([len(ids) for ids in batch["input_ids"]], max_seq_len):
            packed = concatenate((batch["input_ids"][i], batch["labels"][i]) for i in members)
            for column, values in packed.items():
                rows[column].append(values)
        return rows

    return samples.map(pack, batched=True, batch_size=PACK_WINDOW, remove_columns=["input_ids", "labels"],
                       **map_kw)
