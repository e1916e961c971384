"""Rows of token ids -> one micro-batch: the model's keyword arguments and the count of real tokens."""

from dataclasses import dataclass, field

import torch

from llmtune.data import images
from llmtune.data.packing import TOKEN_COLUMNS, pack_units
from llmtune.model.attention import segment_starts
from llmtune.model.loss import IGNORE_INDEX, TOKEN_VALUES, shift_labels
from llmtune.model.multimodal import BLANK_IMAGES


# Inputs the model's forward reads on the host (the attention's document spans, the linear attention's document
# bounds, model/attention.py): they stay in host memory, where reading them waits for nothing.
HOST_INPUTS = frozenset({"document_spans", "document_bounds"})


@dataclass
class MicroBatch:
    inputs: dict[str, torch.Tensor]  # keyword arguments of the training model's forward, shift_labels included
    num_tokens: int  # input tokens that are not padding
    # Rows of two sequences (dpo's pairs, kto's examples): one value per sequence of the micro-batch, numbered as
    # inputs["sequence_ids"] numbers them (number_sequences); empty for other rows.
    sequences: dict[str, torch.Tensor] = field(default_factory=dict)

    def pin_memory(self) -> "MicroBatch":
        """In page-locked memory: DataLoader's pin_memory calls this on the batches it hands out."""
        return MicroBatch({k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in self.inputs.items()},
                          self.num_tokens,
                          {k: v.pin_memory() for k, v in self.sequences.items()})

    def emptied(self) -> "MicroBatch":
        """The same tensors counting nothing: no labelled token, no input token, no sequence (a filler that keeps a
        rank's forwards in step with the others' when its share of a split has run out)."""
        inputs = {**self.inputs, "shift_labels": torch.full_like(self.inputs["shift_labels"], IGNORE_INDEX)}
        if "sequence_ids" in inputs:
            inputs["sequence_ids"] = torch.full_like(inputs["sequence_ids"], -1)
        return MicroBatch(inputs, 0, {k: v[:0] for k, v in self.sequences.items()})

    def to(self, device: torch.device) -> "MicroBatch":
        """On `device`: every tensor copied, once, but those of HOST_INPUTS; the other inputs (a feature's flags
        and lengths) as they are."""
        # From pinned memory the copy to a GPU is queued on its stream and the host goes on; from pageable memory
        # (a feature's new tensors) the host waits for the copy to a staging buffer, not for the device; to the CPU,
        # non_blocking changes nothing.
        return MicroBatch({k: v if k in HOST_INPUTS else moved(v, device) for k, v in self.inputs.items()},
                          self.num_tokens,
                          {k: moved(v, device) for k, v in self.sequences.items()})


def moved(value, device: torch.device):
    return value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad token, else its EOS: many causal LM tokenizers have none, and a pad is never
    attended to nor trained on, so the id only has to be a valid one."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def collate(rows: list[dict], pad_id: int, document_mask: bool = True, two_sequences: bool = False,
            scored: bool = False, pack: bool = False, share_prefixes: bool = False,
            blank_image: bytes | None = None) -> MicroBatch:
    """Right-pad to the longest row; pads carry label -100.

    Rows with position_ids are packed (several documents or samples per row): the model gets
    the position_ids and no attention mask, from which transformers builds a mask that keeps
    attention inside each document; pads get positions of their own so they form a separate
    "document". With document_mask off, an all-ones mask keeps attention across documents.
    Rows without position_ids get an attention mask that hides the pads. Rows without labels
    are labelled with their own ids. Rows of two sequences (`two_sequences`: a preference pair, a KTO example and its
    KL sequence) also number their sequences (sequence_ids); with `scored` (a task whose model ends in a score head),
    they also mark the token each sequence is scored at (score_marks). pack: the rows are units (a pair, an example
    and its KL sequence), packed here into one row (packing.pack_units): the micro-batch holds as many units as it
    was given, with no padding (rows of data.max_seq_len would pad all but the longest). share_prefixes: each unit's
    second sequence leaves out the beginning it shares with its first (share_prefix), for a model whose attention
    attends such rows as it attends each sequence alone (Objective.shares_prefixes). Rows of a vision-language
    model hold their images (images.IMAGES): the micro-batch holds their tensors (image_inputs), or `blank_image`'s
    where it has none.
    """
    if share_prefixes:
        rows = [share_prefix(row, scored) for row in rows]
    if pack:
        rows = pack_units(rows, sum(len(row["input_ids"]) for row in rows))
    length = max(len(row["input_ids"]) for row in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    real = torch.zeros((len(rows), length), dtype=torch.long)
    packed = "position_ids" in rows[0]
    positions = torch.arange(length).repeat(len(rows), 1)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        input_ids[i, :n] = torch.tensor(row["input_ids"])
        labels[i, :n] = torch.tensor(row.get("labels", row["input_ids"]))
        real[i, :n] = 1
        if packed:
            positions[i, :n] = torch.tensor(row["position_ids"])
            positions[i, n:] = torch.arange(length - n)
    inputs = {"input_ids": input_ids, "shift_labels": shift_labels(labels)}
    for column in (column for column in TOKEN_VALUES if column in rows[0]):
        values = torch.zeros((len(rows), length), dtype=torch.float32)
        for i, row in enumerate(rows):
            values[i, :len(row[column])] = torch.tensor(row[column], dtype=torch.float32)
        inputs[column] = values
    if packed:
        inputs["position_ids"] = positions
        if not document_mask:
            inputs["attention_mask"] = torch.ones_like(input_ids)
    else:
        inputs["attention_mask"] = real
    if images.IMAGES in rows[0]:
        inputs.update(image_inputs([blob for row in rows for blob in row[images.IMAGES]], blank_image))
    batch = MicroBatch(inputs, int(real.sum()))
    if not two_sequences:
        return batch
    batch = number_sequences(batch, rows)
    if scored:
        inputs["scored"] = score_marks(input_ids, inputs["sequence_ids"], pad_id)
    return batch


def image_inputs(blobs: list[bytes], blank_image: bytes) -> dict:
    """The vision tower's inputs of a micro-batch's images, in the order of their tokens in its rows laid end to end
    (where the model puts their embeddings): each of the processor's tensors concatenated over the images (Qwen's
    patches and grids, LLaVA's pixels). Without images, the blank image's, and BLANK_IMAGES true: the model encodes
    it and adds nothing of it (model/multimodal.py), so that every rank runs the vision tower on every
    micro-batch."""
    if not blobs:
        return {**images.unblob(blank_image), BLANK_IMAGES: True}
    return images.merged(blobs)


def share_prefix(unit: dict, scored: bool) -> dict:
    """A unit of two sequences (an rm or dpo pair: its chosen sequence, then its rejected one; a kto example and its
    KL sequence) -> the same unit without the tokens the second begins with as the first does, as far as the
    objective reads none of the second's: the second's remaining tokens keep their positions, a branch of the first
    (model/attention.document_starts) whose attention sees the first's tokens before them, as it would see its own.
    Each sequence computes as it does alone, and the shared beginning (a pair's prompt) is computed once.

    What the objective reads of the second decides where its branch begins at the latest: `scored` (rm), its last
    token, where it is scored; else (log-probabilities) the token before its first labelled one, which predicts it:
    that one token of the prompt is computed twice, so that the branch holds every prediction of its labels. The
    branch also starts at the first's last position at the latest, so that its positions jump back: a branch, not
    the first's continuation; and past position 0, which would begin a document. Its first token is labelled -100:
    no token before it in the row predicts it."""
    positions = unit["position_ids"]
    split = positions.index(0, 1)
    first, second = unit["input_ids"][:split], unit["input_ids"][split:]
    labelled = next((i for i, label in enumerate(unit["labels"][split:]) if label != IGNORE_INDEX), len(second))
    read = len(second) - 1 if scored else labelled - 1
    shared = 0
    while shared < min(len(first) - 1, read) and first[shared] == second[shared]:
        shared += 1
    if not shared:
        return unit
    kept = {column: unit[column][:split] + unit[column][split + shared:]
            for column in TOKEN_COLUMNS + TOKEN_VALUES if column in unit}
    kept["labels"][split] = IGNORE_INDEX
    return {**unit, **kept}


def score_marks(input_ids: torch.Tensor, sequence_ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """[b, S] float: 1.0 at each sequence's last token that is not `pad_id`, 0.0 elsewhere: where transformers'
    sequence classifiers read a sequence's score (the rightmost token that is not the config's pad_token_id), so that
    an exported reward model scores a sequence as its training did. Marked before context parallelism slices the
    rows, where a sequence's end may lie on another peer."""
    flat_ids = sequence_ids.flatten()
    kept = (flat_ids >= 0) & (input_ids.flatten() != pad_id)
    positions = torch.arange(len(flat_ids))
    sequences = int(flat_ids.max()) + 1
    last = torch.full((max(sequences, 1),), -1).scatter_reduce(0, flat_ids.clamp(min=0), positions.where(kept, -1),
                                                               "amax")
    marks = torch.zeros(len(flat_ids))
    marks[last[last >= 0]] = 1.0
    return marks.view(input_ids.shape)


def number_sequences(batch: MicroBatch, rows: list[dict]) -> MicroBatch:
    """Adds inputs["sequence_ids"] [b, S]: for every real token the index of its sequence in the micro-batch (numbered
    row by row, in order; a sequence begins where its position_ids do not go on by one), -1 on padding; and per
    sequence its "length" (real tokens) and every column the rows hold besides their tokens, one value per sequence
    of the row, as float64 (a precomputed reference's "ref_logps", kto's "desirable"). A row holds whole pairs,
    chosen first, so sequence 2k is pair k's chosen response (kto: example k's completion) and 2k + 1 its rejected one
    (its KL completion)."""
    ids = torch.full(batch.inputs["input_ids"].shape, -1, dtype=torch.long)
    first = 0
    for i, row in enumerate(rows):
        starts = segment_starts(torch.tensor([row["position_ids"]]))[0]
        ids[i, :len(starts)] = first + torch.cumsum(starts, 0) - 1
        first += int(starts.sum())
    batch.inputs["sequence_ids"] = ids
    batch.sequences["length"] = torch.bincount(ids[ids >= 0], minlength=first)
    for column in (column for column in rows[0] if column not in TOKEN_COLUMNS + TOKEN_VALUES + (images.IMAGES,)):
        batch.sequences[column] = torch.tensor([value for row in rows for value in row[column]], dtype=torch.float64)
    return batch
