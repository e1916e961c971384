"""kto: canonical examples (formats.py) of the mixed split -> each with its KL completion -> rows of two sequences,
built as pairs (preference.py), and each sequence's `desirable` label.

KTO estimates its reference point from mismatched pairs, each example's prompt with another example's completion
(the KTO paper; TRL's KTOTrainer rotates the completions of each batch: prompt i with completion i - 1). Here the
rotation is made once, as the split is built: within windows of packing.PACK_WINDOW examples of the mixed split
(sources mixed first, so that a completion may come from another source), example i takes the completion of example
i - 1, the window's first that of its last. So the KL completions are decided by the data and the recipe alone, the
same on any number of ranks and of data.num_proc (the windows are cut in one process). A window of one example (a
split of one) pairs the example with its own completion.

An example and its KL completion are exactly a pair whose chosen response is the completion and whose rejected one the
KL completion: rendered, checked and cut as dpo's pairs (preference.fitted_pair_row), one row of two sequences, the
example's sequence first. The KL sequence is labelled like the example's, so that its log-probabilities can be
summed; what it weighs is the objective's.
"""

import datasets

from llmtune.data.packing import PACK_WINDOW
from llmtune.data.preference import PAIR_COLUMNS, PairLimits, fitted_pair_row
from llmtune.data.templates import LabelRules
from llmtune.errors import UserError

# A canonical example's label (1.0 desirable, 0.0 undesirable); in a built row, one value per sequence, the
# example's label on both of its sequences.
DESIRABLE = "desirable"
# What a canonical example carries besides its JSON value: its label, and the source and row it was read from.
EXAMPLE_VALUES = {DESIRABLE: datasets.Value("float64"), "where": datasets.Value("string")}
FORM_NAMES = {True: "strings", False: "lists of messages"}


def kl_pair(example: dict, other: dict, where: str, other_where: str) -> dict:
    """The canonical pair of `example` and its KL completion, `other`'s completion: the example's prompt and tools,
    chosen its completion, rejected the other's."""
    if isinstance(example["prompt"], str) != isinstance(other["completion"], str):
        raise UserError(f"{where}: the example is given as {FORM_NAMES[isinstance(example['prompt'], str)]}, and its "
                        f"KL completion, the completion of {other_where}, as "
                        f"{FORM_NAMES[isinstance(other['completion'], str)]}; give every KTO example of a split in "
                        "one form, strings or lists of messages")
    pair = {key: value for key, value in example.items() if key != "completion"}
    return {**pair, "chosen": example["completion"], "rejected": other["completion"]}


def with_kl_completions(examples: datasets.Dataset) -> datasets.Dataset:
    """Canonical examples ({"example", "desirable", "where"}) in the split's order -> {"pair", "desirable", "where"},
    each example paired with the completion of the one before it in its window (cyclic)."""

    def rotate(batch):
        before = batch["example"][-1:] + batch["example"][:-1]
        where_before = batch["where"][-1:] + batch["where"][:-1]
        return {"pair": [kl_pair(*args) for args in zip(batch["example"], before, batch["where"], where_before)]}

    # No num_proc: its shards would cut the windows at other places.
    return examples.map(rotate, batched=True, batch_size=PACK_WINDOW, remove_columns=["example"],
                        features=datasets.Features({"pair": datasets.Json(), **EXAMPLE_VALUES}),
                        desc="pair with KL completions")


def tokenize_examples(examples: datasets.Dataset, tokenizer, data_cfg, limits: PairLimits,
                      map_kw: dict) -> datasets.Dataset:
    """Canonical examples of a whole split, mixed -> one row per example (its sequence, then its KL sequence), its
    status (KEPT, TRUNCATED, NO_LABELS) and `desirable`, one value per sequence."""
    rules = LabelRules.of(data_cfg, tokenizer)

    def encode(row):
        if row["pair"].get("images"):
            raise UserError(f"{row['where']}: the example holds images; llmtune kto trains on text alone so far (dpo "
                            "and sft train on images): leave the images out of the data")
        return {**fitted_pair_row(tokenizer, row["pair"], rules, limits, row["where"]),
                DESIRABLE: [row[DESIRABLE]] * 2}

    return with_kl_completions(examples).map(encode, remove_columns=[DESIRABLE], **map_kw).select_columns(
        [*PAIR_COLUMNS, "status", DESIRABLE])
