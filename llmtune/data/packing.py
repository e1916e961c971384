"""Padding-free packing of sft samples: several samples per row, position_ids restarting per sample.

Rows are filled first-fit-decreasing within windows of samples, deterministic and independent of
the number of ranks. The first token of each sample carries no label, so no label crosses a
sample boundary.
"""

import datasets

from llmtune.loss import IGNORE_INDEX

PACK_WINDOW = 2000


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
            ids, labels, positions = [], [], []
            for i in members:
                ids += batch["input_ids"][i]
                labels += [IGNORE_INDEX] + batch["labels"][i][1:]
                positions += range(len(batch["input_ids"][i]))
            rows["input_ids"].append(ids)
            rows["labels"].append(labels)
            rows["position_ids"].append(positions)
        return rows

    return samples.map(pack, batched=True, batch_size=PACK_WINDOW, remove_columns=["input_ids", "labels"],
                       **map_kw)
