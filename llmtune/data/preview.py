"""`llmtune data`: a recipe's training samples as the trainer sees them, before any training.

It builds (or reads) the same tokenization cache entry as the run, on one process and with no process group, then
prints the first samples with their trained tokens marked (a task of preference pairs: the first pairs, the prompt
once, then the chosen and the rejected response; kto: the first examples, the prompt, then the completion and its
label, not the KL sequence; grpo: the first prompts as rendered, with their other columns), the statistics the run logs and a histogram of the sample (pair, example) lengths.
"""

import math
import os
import sys

import numpy as np
import pyarrow.compute as pc

from llmtune.data import images
from llmtune.data.build import OneProcess, load_or_build, unit_name
from llmtune.data.formats import PROMPT_ROW
from llmtune.data.packing import TOKEN_COLUMNS
from llmtune.data.preference import RESPONSES, PairLimits, two_sequence_rows
from llmtune.data.templates import recipe_tokenizer
from llmtune.data.unpaired import DESIRABLE
from llmtune.errors import UserError
from llmtune.model.loss import IGNORE_INDEX
from llmtune.tasks.registry import PAIRS, PROMPTS, TASKS, UNPAIRED

GREEN, RESET = "\033[32m", "\033[0m"
OPEN, CLOSE = "[[", "]]"
HISTOGRAM_BINS = 10
BAR_WIDTH = 40


def check_previewable(config) -> None:
    """A stream is tokenized as training reads it: there is no built dataset, and no statistics, to show."""
    if config.data.streaming:
        raise UserError("data.streaming: a streaming run builds no dataset ahead, so llmtune data has nothing to show; "
                        "add data.streaming=false to preview the samples (it tokenizes the whole training set)")


def preview(task: str, local, count: int) -> None:
    """Print `count` training samples (pairs, examples) with their trained tokens marked, then the data statistics.
    `local`: the recipe with its Hub ids fetched and its inputs checked (run/inputs.py)."""
    tokenizer = recipe_tokenizer(task, local.model, local.data)
    # The arguments of build_data (manager.py): the same cache key, so the run and this command share one entry.
    train, _, _, stats = load_or_build(task, local.data, tokenizer, local.train.seed,
                                       local.train.per_device_train_batch_size, OneProcess(), PairLimits.of(local))
    show = {PAIRS: show_pairs, UNPAIRED: show_examples, PROMPTS: show_prompts}.get(TASKS[task].rows, show_samples)
    show(tokenizer, train, count, sys.stdout.isatty())
    # The line the run logs; it counts the validation samples too.
    print(f"data: {stats.summary()}")
    lengths = sample_lengths(train)
    if two_sequence_rows(task):
        # What a unit takes of a row: a pair's two sequences, an example's with its KL sequence.
        lengths = lengths.reshape(-1, 2).sum(axis=1)
    print(f"lengths of the {len(lengths)} training {unit_name(task)}:")
    print("\n".join(histogram(lengths)))


def show_samples(tokenizer, train, count: int, color: bool) -> None:
    for number, (ids, trained, continued) in enumerate(first_samples(train, count), 1):
        note = " (continues a document of the previous row)" if continued else ""
        print(f"sample {number}: {len(ids)} tokens, {sum(trained)} trained{note}")
        print(render(tokenizer, ids, trained, color))
        print()


def show_prompts(tokenizer, train, count: int, color: bool) -> None:
    """grpo's prompts as the model is given them (rendered, the generation prompt included; nothing of them is
    trained: the completions sampled from them are), with the columns the reward functions are handed."""
    for number, row in enumerate(train.select(range(min(count, len(train)))), 1):
        columns = {key: value for key, value in row[PROMPT_ROW].items() if key != "prompt"}
        print(f"prompt {number}: {len(row['input_ids'])} tokens; reward functions also get: {columns}")
        print(render(tokenizer, row["input_ids"], [False] * len(row["input_ids"]), color))
        print()


def show_pairs(tokenizer, train, count: int, color: bool) -> None:
    """Each pair's prompt once (the untrained tokens both sequences begin with), then each response: the text its
    sequence adds to the prompt, trained tokens marked."""
    for number, (sequences, _) in enumerate(first_pairs(train, count), 1):
        prompt = prompt_length(sequences)
        counts = ", ".join(f"{name} {len(ids) - prompt} tokens ({sum(trained)} trained)"
                           for name, (ids, trained) in zip(RESPONSES, sequences))
        print(f"pair {number}: prompt {prompt} tokens, {counts}")
        show_responses(tokenizer, list(zip(RESPONSES, sequences)), prompt, color)


def show_examples(tokenizer, train, count: int, color: bool) -> None:
    """Each KTO example's prompt, then its completion, trained tokens marked, and its label. Its KL sequence (the
    prompt with the previous example's completion, unpaired.py) is not shown: it only estimates KTO's reference
    point."""
    print("(each example's KL sequence, its prompt with the previous example's completion, is not shown)\n")
    for number, (sequences, values) in enumerate(first_pairs(train, count), 1):
        (ids, trained), prompt = sequences[0], prompt_length(sequences)
        label = "desirable" if values[DESIRABLE][0] else "undesirable"
        print(f"example {number}: {label}, prompt {prompt} tokens, completion {len(ids) - prompt} tokens "
              f"({sum(trained)} trained)")
        show_responses(tokenizer, [("completion", sequences[0])], prompt, color)


def prompt_length(sequences: list[tuple[list[int], list[bool]]]) -> int:
    """The tokens of the prompt a pair's sequences begin with: the untrained ones before either's first trained
    token."""
    return min(trained.index(True) if True in trained else len(ids) for ids, trained in sequences)


def show_responses(tokenizer, named: list[tuple[str, tuple[list[int], list[bool]]]], prompt: int, color: bool) -> None:
    """The prompt once, then each (name, sequence): the text the sequence adds to the prompt, trained tokens
    marked."""
    ids, trained = named[0][1]
    print(f"prompt:\n{render(tokenizer, ids[:prompt], trained[:prompt], color) if prompt else ''}")
    for name, (ids, trained) in named:
        print(f"{name}:\n{render(tokenizer, ids, trained, color, start=prompt)}")
    print()


def first_pairs(train, count: int):
    """(((input_ids, trained flags) of the first sequence, of the second), {column: the two sequences' values}) of
    the first `count` pairs (kto: examples) in stored order: a row holds whole pairs, chosen first, its sequences
    split where position_ids restart, its other columns one value per sequence."""
    found = 0
    for row in train:
        starts = piece_starts(row["position_ids"])
        spans = list(zip(starts, starts[1:] + [len(row["input_ids"])]))
        for number, pair in enumerate(zip(spans[::2], spans[1::2])):
            yield ([(row["input_ids"][start:end], [label != IGNORE_INDEX for label in row["labels"][start:end]])
                    for start, end in pair],
                   {column: values[2 * number:2 * number + 2] for column, values in row.items()
                    if column not in TOKEN_COLUMNS})
            found += 1
            if found == count:
                return


def first_samples(train, count: int):
    """(input_ids, trained flags, whether it continues a document cut at the previous row's end) of the first
    `count` samples in stored order: a packed row holds several, split where position_ids restart."""
    packed = "position_ids" in train.column_names
    found = 0
    for row in train:
        starts = piece_starts(row["position_ids"]) if packed else [0]
        for start, end in zip(starts, starts[1:] + [len(row["input_ids"])]):
            labels = row["labels"][start:end]
            # The loss shifts labels left, so a row's first token is never a target even when labelled (an unpacked
            # row, or a pt document cut at a block boundary); packed samples already carry -100 there.
            trained = [label != IGNORE_INDEX and start + i > 0 for i, label in enumerate(labels)]
            # A packed sample's first token carries no label (packing.concatenate); a piece whose first token has
            # one is the rest of a pt document cut at the previous row's end.
            yield row["input_ids"][start:end], trained, packed and labels[0] != IGNORE_INDEX
            found += 1
            if found == count:
                return


def piece_starts(position_ids: list[int]) -> list[int]:
    """Where the samples of a packed row begin: the row's start (a pt document may go on from the previous row)
    and every restart of position_ids."""
    return [0] + [i for i, position in enumerate(position_ids) if position == 0 and i > 0]


def render(tokenizer, ids: list[int], trained: list[bool], color: bool, start: int = 0) -> str:
    """The sample's text with its trained runs marked, from token `start` on (a pair's response without the prompt,
    which is shown once).

    Each run is a slice of the whole sample's decoded text, cut where the decoded prefix before the run stops
    agreeing with it; a run is not decoded on its own: a sentencepiece tokenizer drops a leading space when
    decoding from a word-initial piece, and a byte-level one turns a character whose bytes a run boundary splits
    into U+FFFD (here that character goes whole to the later run). So the unmarked text is exactly the sample's;
    special tokens stay in and tokenization spaces are not cleaned up: what is shown is what the model reads. A
    vision-language model's image tokens (never trained) are shown collapsed, each run as its token and count.
    """
    bounds = [start] + [i for i in range(start + 1, len(ids)) if trained[i] != trained[i - 1]] + [len(ids)]
    prefixes = [tokenizer.decode(ids[:end], skip_special_tokens=False, clean_up_tokenization_spaces=False)
                for end in bounds]
    whole = prefixes[-1]
    cuts = [len(os.path.commonprefix([prefix, whole])) for prefix in prefixes]
    text = "".join(mark(whole[cut:next_cut], color) if trained[start] else whole[cut:next_cut]
                   for start, cut, next_cut in zip(bounds, cuts, cuts[1:]))
    return image_inputs.collapsed(text) if (image_inputs := images.of(tokenizer)) else text


def mark(text: str, color: bool) -> str:
    """Green on a terminal; brackets elsewhere (a file, a pipe, a test), where colour codes would be noise."""
    return f"{GREEN}{text}{RESET}" if color else f"{OPEN}{text}{CLOSE}"


def sample_lengths(train) -> np.ndarray:
    """Token counts of every sample, on the Arrow columns (one pass in Python over the rows would be slow on a large
    set): rows when unpacked, pieces between position_ids restarts (and row starts) when packed."""
    table = train.data
    if "position_ids" not in train.column_names:
        return np.asarray(pc.list_value_length(table.column("input_ids")))
    positions = np.asarray(pc.list_flatten(table.column("position_ids")))
    row_starts = np.cumsum(np.asarray(pc.list_value_length(table.column("position_ids"))))[:-1]
    starts = np.union1d(np.flatnonzero(positions == 0), np.concatenate([[0], row_starts]))
    return np.diff(np.append(starts, len(positions)))


def histogram(lengths: np.ndarray) -> list[str]:
    """About HISTOGRAM_BINS lines `  lo-hi tokens | ###  count`, of bins of equal integer width."""
    low, high = int(lengths.min()), int(lengths.max())
    width = math.ceil((high - low + 1) / HISTOGRAM_BINS)
    counts = np.bincount((lengths - low) // width)
    ranges = [f"{low + i * width}-{min(low + (i + 1) * width - 1, high)}" for i in range(len(counts))]
    span = max(len(text) for text in ranges)
    # A non-empty bin gets at least one mark, so that it never looks empty.
    bars = ["#" * math.ceil(BAR_WIDTH * n / counts.max()) for n in counts]
    return [f"  {text:>{span}} tokens | {bar:<{BAR_WIDTH}}  {n}" for text, bar, n in zip(ranges, bars, counts)]
