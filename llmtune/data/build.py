"""Sources -> canonical rows -> tokens -> (packing) -> the train and validation datasets.

Each task's rows (tasks/registry.py's `rows`) take their own path: documents are packed into blocks (pretrain.py),
conversations become samples (sft.py), preference pairs rows of two sequences (preference.py), KTO's examples too,
each with its KL completion, once the split's sources are mixed (unpaired.py), grpo's prompts their token ids and the
row they came from (prompts.py); the path is read from the rows, never from the task's name.

Preprocessing is paid once: the result is saved under a key of (source fingerprints: each
file's size and mtime, a Hub dataset's repository, config, split and commit; tokenizer,
transform settings, and the PairLimits of a task whose rows are built as pairs); on N ranks, local rank 0 of each
node builds it while the others wait, then every rank memory-maps the same files. A streaming run tokenizes its
training sources as it reads them; only its validation and test splits (data.val_files, data.test_files) are built
here.
"""

import hashlib
import json
import logging
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute as pc

from llmtune.cpus import usable_cpus
from llmtune.data import images, packing, preference, pretrain, prompts, sft, unpaired
from llmtune.data.files import is_saved_dataset, resolve_data_files
from llmtune.data.formats import (KTO_LABEL, PROMPT_ROW, ROWS_FORMS, canonical_columns, check_columns, detect_format,
                                  other_rows_error, to_canonical)
from llmtune.data.preference import PairLimits, two_sequence_rows
from llmtune.data.registry import Source, split_sources
from llmtune.data.sources import load_source, undecodable_error
from llmtune.errors import UserError
from llmtune.hub import dataset_source, fetch
from llmtune.model.loss import IGNORE_INDEX
from llmtune.tasks.registry import CONVERSATIONS, DOCUMENTS, PAIRS, PROMPTS, TASKS, UNPAIRED

log = logging.getLogger(__name__)

# Bump when a change to the transforms changes their output, so old caches are not reused.
CACHE_VERSION = 4
# Settings that do not change the built datasets, left out of the cache key. (data.streaming does: a
# streaming run's entry holds its validation and test splits only.)
NOT_IN_KEY = ("shuffle", "shuffle_buffer", "num_proc", "cache_dir", "document_mask")
# The folders of a cache entry, each a split the recipe may have.
SPLITS = ("train", "val", "test")
# The canonical columns that are not inferred: a sample, a pair or an example is one JSON value (formats.py says why).
CANONICAL_FEATURES = {"sample": datasets.Json(), "pair": datasets.Json(), "example": datasets.Json(),
                      PROMPT_ROW: datasets.Json(), **unpaired.EXAMPLE_VALUES}


def unit_name(task: str) -> str:
    """What a task's statistics count: pairs (dpo), examples (kto, each a row of two sequences with its KL
    sequence), else samples."""
    return {PAIRS: "pairs", UNPAIRED: "examples", PROMPTS: "prompts"}.get(TASKS[task].rows, "samples")


@dataclass
class DataStats:
    task: str
    samples: int  # sft: the samples kept, however many a row holds; dpo: the pairs kept; kto: the examples kept
    rows: int  # the rows the model is given: packed rows, one sample (pair) each, or pt's blocks
    max_seq_len: int
    tokens: int
    label_tokens: int
    truncated: int
    dropped_too_long: int
    dropped_no_labels: int
    fully_labelled: int  # samples whose every token is labelled: no prompt was masked
    efficiency: float  # non-pad tokens / all tokens of the batches the model will see
    val_samples: int
    test_samples: int
    desirable: int = 0  # kto: the examples kept that are labelled desirable (the others are undesirable)
    packed_per_batch: bool = False  # pairs (examples) packed into rows as each micro-batch is made
    # pt: the tokens of the last, shorter block of each packing window, dropped (data.pt_remainder: drop)
    dropped_tail_tokens: int = 0
    images: int = 0  # a vision-language model's: the images of the samples (pairs) kept
    image_tokens: int = 0  # the tokens the processor gave them (every sequence of a pair holds its prompt's)

    def summary(self) -> str:
        rows, unit = TASKS[self.task].rows, unit_name(self.task)
        counted = f"{self.samples} {unit}"
        if rows == UNPAIRED:
            counted += f" ({self.desirable} desirable, {self.samples - self.desirable} undesirable)"
        if rows == PROMPTS:
            test = f", {self.test_samples} test {unit}" if self.test_samples else ""
            return (f"{counted}, {self.tokens} tokens, {self.dropped_too_long} dropped as longer than "
                    f"data.max_seq_len={self.max_seq_len}{test}")
        if rows == DOCUMENTS:
            kept = (f"{self.rows} rows of up to {self.max_seq_len} tokens ({self.dropped_tail_tokens} tokens of the "
                    "last, partial rows dropped)")
        elif self.packed_per_batch:
            kept = f"{counted}, each micro-batch's packed into one row"
        elif self.rows != self.samples:
            kept = f"{counted} packed into {self.rows} rows of up to {self.max_seq_len} tokens"
        else:
            kept = f"{counted}, one per row"
        if two_sequence_rows(self.task):
            dropped = self.dropped_too_long + self.dropped_no_labels
            counts = (f"{self.truncated} truncated ({self._share(self.truncated)}), {dropped} dropped "
                      f"({self._share(dropped)})")
        else:
            counts = (f"{self.truncated} truncated, {self.dropped_too_long} dropped as too long, "
                      f"{self.dropped_no_labels} dropped with no label ({self._share(self.dropped_no_labels)}), "
                      f"{self.fully_labelled} with every token labelled ({self._share(self.fully_labelled)})")
        test = f", {self.test_samples} test {unit}" if self.test_samples else ""
        if self.images:
            kept += f", {self.images} images ({self.image_tokens} image tokens)"
        return (f"{kept}, {self.tokens} tokens, label tokens {self.label_tokens / max(self.tokens, 1):.1%}, {counts}, "
                f"efficiency {self.efficiency:.1%} (non-pad tokens), {self.val_samples} validation {unit}{test}")

    def _share(self, count: int) -> str:
        """`count` as a share of every sample (pair, example) read (the kept ones and the dropped ones)."""
        read = self.samples + self.dropped_too_long + self.dropped_no_labels
        return f"{count / max(read, 1):.1%}"


def sample_count(split: datasets.Dataset, task: str) -> int:
    """The samples (pairs, examples) of a split: in packed rows, the positions that restart at 0 (a packed sample is
    never cut between rows; pt's blocks, which do cut documents, count as rows), two to a pair or an example."""
    if "position_ids" not in split.column_names:
        return len(split)
    starts = pc.equal(pc.list_flatten(split.data.column("position_ids")), 0)
    return int(pc.sum(starts).as_py() or 0) // (2 if two_sequence_rows(task) else 1)


def desirable_count(split: datasets.Dataset) -> int:
    """The examples labelled desirable in a split of KTO's rows (its `desirable` values, two to an example), 0 in
    another's; read through the split's indices (a filtered split's table still holds the rows it dropped)."""
    if unpaired.DESIRABLE not in split.column_names:
        return 0
    values = split.select_columns([unpaired.DESIRABLE]).with_format("arrow")[:][unpaired.DESIRABLE]
    return int(pc.sum(pc.list_flatten(values)).as_py() or 0) // 2


def map_options(dataset, num_proc: int, desc: str) -> dict:
    """datasets' map options; an iterable (streaming) dataset takes neither. No more processes than the CPUs this
    process may run on (LLaMA-Factory's examples ask 16): more would only take turns on them, each a process to
    start and a connection to its pool's manager; the rows come out the same for any number."""
    if isinstance(dataset, datasets.IterableDataset):
        return {}
    processes = min(num_proc, usable_cpus())
    return {"num_proc": processes if processes > 1 else None, "desc": desc}


def boolean_label(rows) -> bool:
    """Whether the rows' label column holds true/false (TRL's KTO form). Its type tells where the reader typed it;
    CSV columns are all read as text (sources.py) and a stream need not know its types: there the first row tells."""
    feature = (rows.features or {}).get(KTO_LABEL)
    if feature is not None and feature != datasets.Value("string"):
        return feature == datasets.Value("bool")
    value = next(iter(rows), {}).get(KTO_LABEL)
    return isinstance(value, bool) or str(value).lower() in ("true", "false")


def canonical_rows(source: Source, task: str, data_cfg, streaming: bool):
    """(the source's rows in canonical form, its form)."""
    rows = load_source(source.pattern, source.key, streaming, data_cfg.text_sample_by)
    if data_cfg.max_samples is not None:
        rows = rows.take(data_cfg.max_samples) if streaming else \
            rows.select(range(min(data_cfg.max_samples, len(rows))))
    columns = rows.column_names or list(next(iter(rows)).keys())
    # Before the form is detected: preference rows would be read as a conversation, or dropped with no label.
    if error := other_rows_error(source.pattern, columns, KTO_LABEL in columns and boolean_label(rows), task,
                                 source.key):
        raise error
    if source.row_format:
        row_format = source.row_format
        check_columns(row_format, columns, source.pattern, f"its {source.key} entry ({row_format.form})")
    else:
        row_format = detect_format(columns, task, data_cfg.format, source.pattern)

    media_dir = media_folder(source)

    def convert(row, index):
        return to_canonical(row, row_format, f"{source.pattern}: row {index + 1}", media_dir)

    canonical = canonical_columns(row_format.form)
    features = datasets.Features({column: CANONICAL_FEATURES[column] for column in canonical}) \
        if canonical[0] in CANONICAL_FEATURES else None
    try:
        converted = rows.map(convert, with_indices=True, remove_columns=columns, features=features,
                             **map_options(rows, data_cfg.num_proc, f"read {Path(source.pattern).name}"))
    except UnicodeDecodeError as err:
        raise undecodable_error(source.pattern, source.key, err) from None
    return converted.select_columns(list(canonical)), row_format.form


def media_folder(source: Source) -> Path | None:
    """Where a source's relative image paths are found first: LLaMA-Factory's dataset_dir for its entries, else the
    data file's folder (the folder itself for a folder of files); None for a Hub dataset, whose images are in it."""
    if source.media_dir:
        return Path(source.media_dir)
    path = Path(source.pattern)
    return path.parent if path.is_file() else path if path.is_dir() else None


def tokenize_source(rows, form: str, tokenizer, data_cfg, source: Source, pair_limits: PairLimits | None):
    """Canonical rows of `source` -> (input_ids, labels (and position_ids for pt blocks and pairs); samples and pairs
    keep a status column, the tokens of pt's documents that no block holds: the last, shorter block of each packing
    window, dropped)."""
    if form == "text":
        docs = pretrain.tokenize_documents(rows, tokenizer, map_options(rows, data_cfg.num_proc, "tokenize"))
        # A stream cannot be checked or counted without reading it.
        streamed = not isinstance(docs, datasets.Dataset)
        if not streamed and not pretrain.has_text_tokens(docs, tokenizer):
            raise UserError(f"{source.key}: the tokenizer in {tokenizer.name_or_path} produced no tokens for the "
                            f"documents of {source.pattern}; set model.tokenizer to one made for this text, or check "
                            "the file")
        blocks = pretrain.pack_documents(docs, data_cfg.max_seq_len, data_cfg.pt_remainder,
                                         map_options(rows, data_cfg.num_proc, "pack"))
        return blocks, 0 if streamed else pretrain.token_count(docs) - pretrain.token_count(blocks)
    if form in ROWS_FORMS[PROMPTS]:
        return prompts.tokenize_prompts(rows, tokenizer, data_cfg.max_seq_len,
                                        map_options(rows, data_cfg.num_proc, "tokenize"), source.pattern), 0
    if form in ROWS_FORMS[PAIRS]:
        return preference.tokenize_pairs(rows, tokenizer, data_cfg, pair_limits,
                                         map_options(rows, data_cfg.num_proc, "tokenize"), source.pattern), 0
    return sft.tokenize_examples(rows, tokenizer, data_cfg, map_options(rows, data_cfg.num_proc, "tokenize"),
                                 source.pattern), 0


def mix(parts: list[datasets.Dataset], weights: list[float], seed: int) -> datasets.Dataset:
    """Concatenate the sources; with weights, source i gives round(total * w_i / sum(w)) samples,
    drawn from a seeded permutation of it (repeated when it has fewer)."""
    combined = datasets.concatenate_datasets(parts)
    if not weights:
        return combined
    total, rng, indices, offset = len(combined), np.random.default_rng(seed), [], 0
    for part, weight in zip(parts, weights):
        wanted = round(total * weight / sum(weights))
        order = rng.permutation(len(part))
        indices.append(np.resize(order, wanted) + offset)
        offset += len(part)
    return combined.select(np.concatenate(indices)).flatten_indices()


def count_statuses(samples: datasets.Dataset) -> tuple[datasets.Dataset, dict[int, int]]:
    if "status" not in samples.column_names:
        return samples, {}
    values, counts = np.unique(np.asarray(samples.data.column("status")), return_counts=True)
    statuses = dict(zip(values.tolist(), counts.tolist()))
    kept = samples.filter(lambda status: status in (sft.KEPT, sft.TRUNCATED), input_columns="status")
    return kept.remove_columns("status"), statuses


def length_stats(samples: datasets.Dataset) -> tuple[np.ndarray, int]:
    """Per-row lengths and the number of labels that count after the shift (all but each row's first; none for rows
    without labels, grpo's prompts)."""
    table = samples.data  # read back from the cache: flat, no indices mapping
    lengths = np.asarray(pc.list_value_length(table.column("input_ids")))
    if "labels" not in table.column_names:
        return lengths, 0
    labels = table.column("labels")
    labelled = pc.sum(pc.not_equal(pc.list_flatten(labels), IGNORE_INDEX)).as_py() or 0
    first = pc.sum(pc.not_equal(pc.list_element(labels, 0), IGNORE_INDEX)).as_py() or 0
    return lengths, labelled - first


def fully_labelled(samples: datasets.Dataset) -> int:
    """How many samples have every token labelled, counted on the Arrow column (read through the dataset's
    indices: a filtered split's table still holds the rows it dropped)."""
    labels = samples.select_columns(["labels"]).with_format("arrow")[:]["labels"]
    labelled = np.bincount(np.asarray(pc.list_parent_indices(labels)),
                           weights=np.asarray(pc.not_equal(pc.list_flatten(labels), IGNORE_INDEX)),
                           minlength=len(samples))
    return int((labelled == np.asarray(pc.list_value_length(labels))).sum())


def padded_efficiency(lengths: np.ndarray, batch_size: int, seed: int) -> float:
    """Non-pad share of batches padded to their longest row, over one seeded shuffle."""
    if not len(lengths):
        return 0.0
    order = lengths[np.random.default_rng(seed).permutation(len(lengths))]
    padded = sum(int(chunk.max()) * len(chunk) for chunk in np.array_split(order, math.ceil(len(order) / batch_size)))
    return float(lengths.sum()) / padded


def tokenized_sources(sources: list[Source], task: str, tokenizer, data_cfg, streaming: bool,
                      pair_limits: PairLimits | None = None):
    """(one tokenized dataset per source, whether they are samples rather than packed pt blocks, the tokens of pt's
    documents the blocks dropped)."""
    canonical = [canonical_rows(source, task, data_cfg, streaming) for source in sources]
    kinds = {form == "text" for _, form in canonical}
    if len(kinds) > 1:
        raise UserError(f"{sources[0].key}: raw text and pre-tokenized sources cannot be mixed in one run; "
                        "tokenize the text sources too, or train on them separately")
    tokenized = [tokenize_source(rows, form, tokenizer, data_cfg, source, pair_limits)
                 for source, (rows, form) in zip(sources, canonical)]
    return [part for part, _ in tokenized], kinds == {False}, sum(dropped for _, dropped in tokenized)


def build_split(sources: list[Source], weights: list[float], task: str, tokenizer, data_cfg, seed: int,
                pair_limits: PairLimits | None):
    """(the split's rows, the count of each status of its samples, the tokens of pt's documents the blocks
    dropped)."""
    if TASKS[task].rows == UNPAIRED:
        # An example's KL completion is another example's of the split, whichever source it came from.
        examples = mix([canonical_rows(source, task, data_cfg, False)[0] for source in sources], weights, seed)
        return *count_statuses(unpaired.tokenize_examples(examples, tokenizer, data_cfg, pair_limits,
                                                          map_options(examples, data_cfg.num_proc, "tokenize"))), 0
    parts, _, dropped = tokenized_sources(sources, task, tokenizer, data_cfg, False, pair_limits)
    return *count_statuses(mix(parts, weights, seed)), dropped


def build_stream(task: str, data_cfg, tokenizer, seed: int) -> datasets.IterableDataset:
    """The streaming pipeline: the same transforms, applied lazily as samples are read."""
    parts, samples, _ = tokenized_sources(split_sources(data_cfg, task, "train"), task, tokenizer, data_cfg, True)
    weights = data_cfg.mix_weights
    stream = datasets.interleave_datasets(parts, probabilities=[w / sum(weights) for w in weights], seed=seed,
                                          stopping_strategy="all_exhausted") if weights and len(parts) > 1 \
        else datasets.concatenate_datasets(parts)
    if samples:
        stream = stream.filter(lambda status: status in (sft.KEPT, sft.TRUNCATED), input_columns="status")
        stream = stream.remove_columns("status")  # as count_statuses leaves a map-style split: images kept
        if data_cfg.packing:
            stream = packing.pack_samples(stream, data_cfg.max_seq_len, {})
    return stream


def packed_split(split: datasets.Dataset | None, task: str, data_cfg) -> datasets.Dataset | None:
    """Samples (sft, pre-tokenized) packed into rows when data.packing is on; pt text arrives as packed blocks; pairs
    and KTO's examples stay one per row, packed by the collator into each micro-batch's rows; grpo's prompts stay one
    per row (their training rows are made of their completions)."""
    blocks = split is not None and TASKS[task].rows == DOCUMENTS and "position_ids" in split.column_names
    if split is None or not data_cfg.packing or blocks or TASKS[task].rows == PROMPTS or two_sequence_rows(task):
        return split
    return packing.pack_samples(split, data_cfg.max_seq_len, map_options(split, data_cfg.num_proc, "pack"))


def build_held_out(split: str, task: str, data_cfg, tokenizer, seed: int,
                   pair_limits: PairLimits | None = None) -> datasets.Dataset | None:
    """The validation ("val": data.val_files and data.val_datasets) or test ("test": data.test_files and
    data.test_datasets) split, packed as training rows are; None when the recipe names no source for it."""
    sources = split_sources(data_cfg, task, split)
    if not sources:
        return None
    held_out, _, _ = build_split(sources, [], task, tokenizer, data_cfg, seed, pair_limits)
    return packed_split(held_out, task, data_cfg)


def build_datasets(task: str, data_cfg, tokenizer, seed: int, pair_limits: PairLimits | None = None):
    """(train, validation or None, counts of truncated and dropped samples), built from scratch. `pair_limits`: those
    of a task whose rows are built as pairs (PairLimits.of)."""
    train, statuses, dropped_tail = build_split(split_sources(data_cfg, task, "train"), data_cfg.mix_weights, task,
                                                tokenizer, data_cfg, seed, pair_limits)
    too_long, no_labels = statuses.get(sft.TOO_LONG, 0), statuses.get(sft.NO_LABELS, 0)
    if not len(train) and dropped_tail:
        raise pretrain.no_block_error(dropped_tail, data_cfg.max_seq_len)
    if not len(train) and too_long and not no_labels:
        raise UserError(f"data: every one of the {too_long} samples is longer than data.max_seq_len="
                        f"{data_cfg.max_seq_len}; raise data.max_seq_len")
    if not len(train):
        raise UserError(f"data.train_files: no training sample is left after tokenization and filtering "
                        f"({no_labels} had no label token, {too_long} were too long); check the data and data.format")
    conversations = TASKS[task].rows == CONVERSATIONS
    every_token = fully_labelled(train) if conversations else 0
    if every_token == len(train) and conversations and not data_cfg.train_on_prompt:
        raise UserError(f"data: every token of all {len(train)} training samples is labelled, so the prompts would be "
                        "trained as well as the answers: no prompt was found to mask (pre-tokenized rows without "
                        "labels, or a chat template that renders no prompt); check data.format and "
                        "data.chat_template, or set data.train_on_prompt: true if this is meant")
    val = build_held_out("val", task, data_cfg, tokenizer, seed, pair_limits)
    if val is None and data_cfg.val_ratio > 0:
        split = train.train_test_split(test_size=max(1, round(len(train) * data_cfg.val_ratio)), seed=seed)
        train, val = split["train"], packed_split(split["test"], task, data_cfg)
    counts = {"truncated": statuses.get(sft.TRUNCATED, 0), "dropped_too_long": too_long,
              "dropped_no_labels": no_labels, "fully_labelled": every_token, "dropped_tail_tokens": dropped_tail}
    return packed_split(train, task, data_cfg), val, counts


def describe(task: str, train: datasets.Dataset, val, test, counts: dict, data_cfg, batch_size: int,
             seed: int, image_token_id: int | None) -> DataStats:
    lengths, label_tokens = length_stats(train)
    per_batch = two_sequence_rows(task) and data_cfg.packing
    if per_batch:  # one row a micro-batch: no padding
        efficiency = 1.0
    elif "position_ids" in train.column_names and not two_sequence_rows(task):  # packed samples or blocks
        efficiency = float(lengths.sum()) / (len(lengths) * data_cfg.max_seq_len)
    else:
        efficiency = padded_efficiency(lengths, batch_size, seed)
    return DataStats(task=task, samples=sample_count(train, task), rows=len(train), max_seq_len=data_cfg.max_seq_len,
                     tokens=int(lengths.sum()), label_tokens=label_tokens, efficiency=efficiency,
                     val_samples=sample_count(val, task) if val is not None else 0,
                     test_samples=sample_count(test, task) if test is not None else 0,
                     desirable=desirable_count(train), packed_per_batch=per_batch,
                     **image_stats(train, task, image_token_id), **counts)


def image_stats(samples: datasets.Dataset, task: str, image_token_id: int | None) -> dict:
    """DataStats' images and image_tokens of a vision-language model's rows (none for a text model's): each row's
    blobs, one per image, a pair's once for each of its two sequences."""
    if image_token_id is None:
        return {}
    table = samples.data
    blobs = pc.sum(pc.list_value_length(table.column(images.IMAGES))).as_py() or 0
    tokens = pc.sum(pc.equal(pc.list_flatten(table.column("input_ids")), image_token_id)).as_py() or 0
    return {"images": blobs // 2 if two_sequence_rows(task) else blobs, "image_tokens": tokens}


def cache_key(task: str, data_cfg, tokenizer, seed: int, pair_limits: PairLimits | None = None) -> str:
    settings = {k: v for k, v in asdict(data_cfg).items() if k not in NOT_IN_KEY}
    splits = ("val", "test") if data_cfg.streaming else ("train", "val", "test")
    sources = [[_fingerprint(s.pattern, s.key), asdict(s.row_format) if s.row_format else None]
               for split in splits for s in split_sources(data_cfg, task, split)]
    tok = tokenizer.backend_tokenizer.to_str() if hasattr(tokenizer, "backend_tokenizer") else \
        json.dumps(sorted(tokenizer.get_vocab().items()))
    parts = [CACHE_VERSION, task, settings, seed, sources, type(tokenizer).__name__,
             hashlib.sha256(tok.encode()).hexdigest(), tokenizer.chat_template, tokenizer.eos_token_id]
    # Only a task whose rows are built as pairs has limits: the other tasks' keys stay those their cache entries were
    # saved under.
    if pair_limits is not None:
        parts.append(asdict(pair_limits))
    # A vision-language model's image processing decides its rows' image tokens and tensors; a text model's key is
    # what it was before images existed.
    if image_inputs := images.of(tokenizer):
        parts.append(image_inputs.key())
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _fingerprint(pattern: str, key: str) -> list:
    if hub_source := dataset_source(pattern, key):
        # A commit never changes: the repository, config, split and commit name the rows.
        commit = fetch(hub_source.repo, key, local_files_only=True).name
        return [hub_source.repo.repo_id, hub_source.config, hub_source.split, commit]
    if is_saved_dataset(pattern):
        return [pattern, (Path(pattern) / "state.json").read_text() if (Path(pattern) / "state.json").is_file()
                else (Path(pattern) / "dataset_dict.json").read_text()]
    return [(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in resolve_data_files([pattern], key)]


def cache_root(data_cfg) -> Path:
    if data_cfg.cache_dir:
        return Path(data_cfg.cache_dir)
    return Path(os.environ.get("LLMTUNE_CACHE", Path.home() / ".cache" / "llmtune")) / "data"


def load_or_build(task: str, data_cfg, tokenizer, seed: int, batch_size: int, state,
                  pair_limits: PairLimits | None = None):
    """(train, validation or None, test or None, stats), from the cache entry of this recipe (built if missing).
    `pair_limits`: those of a task whose rows are built as pairs (PairLimits.of)."""

    def build():
        train, val, counts = build_datasets(task, data_cfg, tokenizer, seed, pair_limits)
        return train, val, build_held_out("test", task, data_cfg, tokenizer, seed, pair_limits), counts

    folder = cached_entry(task, data_cfg, tokenizer, seed, state, build, pair_limits)
    train, val, test = (cached_split(folder, name) for name in SPLITS)
    counts = json.loads((folder / "counts.json").read_text())
    image_inputs = images.of(tokenizer)
    stats = describe(task, train, val, test, counts, data_cfg, batch_size, seed,
                     image_inputs.image_token_id if image_inputs else None)
    if not stats.label_tokens and TASKS[task].rows != PROMPTS:
        raise UserError(f"data.train_files: the {stats.rows} training rows hold no label token, so there is nothing "
                        f"to train on; check that the tokenizer in {tokenizer.name_or_path} fits the data and that "
                        f"data.max_seq_len ({data_cfg.max_seq_len}) holds whole documents")
    return train, val, test, stats


def load_or_build_stream_held_out(task: str, data_cfg, tokenizer, seed: int, state):
    """A streaming run's (validation or None, test or None): data.val_files and data.test_files built map-style,
    like any other run's, so an evaluation reads the whole split and every data-parallel rank its share of it."""
    folder = cached_entry(task, data_cfg, tokenizer, seed, state,
                          lambda: (None, *(build_held_out(name, task, data_cfg, tokenizer, seed)
                                           for name in ("val", "test")), {}))
    return cached_split(folder, "val"), cached_split(folder, "test")


def cached_split(folder: Path, name: str) -> datasets.Dataset | None:
    """One split of a cache entry (SPLITS), None where the recipe has none."""
    return datasets.load_from_disk(str(folder / name)) if (folder / name).is_dir() else None


class OneProcess:
    """The `state` a build takes (ParallelState's local_rank and first_error), for one process without a process
    group: `llmtune data`."""
    local_rank = 0

    wait_group = None

    @staticmethod
    def first_error(error: str | None, group=None) -> str | None:
        return error


def cached_entry(task: str, data_cfg, tokenizer, seed: int, state, build,
                 pair_limits: PairLimits | None = None) -> Path:
    """The folder of this recipe's cache entry, which local rank 0 of each node fills with build() ->
    (train or None, validation or None, test or None, counts) if it is missing, while the others wait.

    state.first_error is the barrier after the build, and it makes every rank stop with the
    builder's message on bad data (a rank left waiting would otherwise die of the closed
    connection instead). It waits on state.wait_group, not the training group: tokenizing a large
    corpus may take longer than parallel.timeout_minutes.
    """
    folder = cache_root(data_cfg) / cache_key(task, data_cfg, tokenizer, seed, pair_limits)
    built, error = False, None
    if state.local_rank == 0 and not (folder / "counts.json").is_file():
        started = time.perf_counter()
        try:
            _save_entry(folder, *build())
            log.info("data: built %s in %.1f s", folder, time.perf_counter() - started)
            built = True
        except UserError as err:
            error = str(err)
    error = state.first_error(error, state.wait_group)
    if error:
        raise UserError(error)
    if not built:
        log.info("data: cache hit %s (no tokenization)", folder)
    return folder


def _save_entry(folder: Path, train, val, test, counts: dict) -> None:
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    try:
        for name, split in zip(SPLITS, (train, val, test)):
            if split is not None:
                split.save_to_disk(str(partial / name))
        # Written last: its presence marks a complete entry.
        (partial / "counts.json").write_text(json.dumps(counts))
    except BaseException:  # also Ctrl-C: no half-written entry is left behind
        shutil.rmtree(partial, ignore_errors=True)
        raise
    try:
        partial.rename(folder)
    except OSError:  # another node's rank 0 finished the same entry first
        shutil.rmtree(partial, ignore_errors=True)
