"""Padding-free packing: several samples (sft), documents (pt), preference pairs (dpo) or KTO's examples (kto) per
row, position_ids restarting at each sequence.

The first token of each sequence carries no label, so no label (after the shift) asks one sequence to
predict the next. sft rows are filled first-fit-decreasing within windows of samples when the data is built,
deterministic and independent of the number of ranks; the pairs of dpo, rm and kto (two sequences, never split) are
packed into one row when a micro-batch is made of them (collate.collate), so that a step trains as many pairs as the
recipe says, as TRL and LLaMA-Factory count them. A unit's other columns hold one
value per sequence (kto's `desirable`): they are concatenated in the same order, so they stay in line with the
sequences.
"""

import datasets

from llmtune.model.loss import IGNORE_INDEX

# Samples and documents are packed within windows of this many, so memory stays bounded; for pt
# what is left at the end of a window is dropped or kept as a shorter block (data.pt_remainder),
# a small fraction of the corpus.
PACK_WINDOW = 2000
# The columns of token values; any other column of a row of sequences holds one value per sequence.
TOKEN_COLUMNS = ("input_ids", "labels", "position_ids")


def concatenate(units) -> dict[str, list[int]]:
    """(input_ids, labels) of a sequence, or (input_ids, labels, position_ids) of a unit that already holds several
    (a preference pair, whose positions are kept) -> one packed row: input_ids, labels and position_ids."""
    packed: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}
    for input_ids, labels, *positions in units:
        packed["input_ids"] += input_ids
        packed["labels"] += [IGNORE_INDEX] + labels[1:]
        packed["position_ids"] += positions[0] if positions else range(len(input_ids))
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
    """Units (samples) -> rows of at most max_seq_len tokens, packed within windows of PACK_WINDOW."""

    def pack(batch):
        units = [dict(zip(batch, values)) for values in zip(*batch.values())]
        rows = pack_units(units, max_seq_len)
        return {column: [row[column] for row in rows] for column in rows[0]}

    return samples.map(pack, batched=True, batch_size=PACK_WINDOW, remove_columns=samples.column_names, **map_kw)


def pack_units(units: list[dict], max_seq_len: int) -> list[dict]:
    """Units (samples, or pairs with their position_ids and any per-sequence values) -> rows of at most max_seq_len
    tokens, first-fit-decreasing: a sample's window (pack_samples), or a micro-batch's pairs into one row
    (collate.collate)."""
    columns = [column for column in TOKEN_COLUMNS if column in units[0]]
    per_sequence = [column for column in units[0] if column not in TOKEN_COLUMNS]
    rows = []
    for members in first_fit_decreasing([len(unit["input_ids"]) for unit in units], max_seq_len):
        packed = concatenate([units[i][column] for column in columns] for i in members)
        packed.update({column: [value for i in members for value in units[i][column]] for column in per_sequence})
        rows.append(packed)
    return rows
