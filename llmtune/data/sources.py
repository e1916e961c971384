"""Read data sources into `datasets` objects (memory-mapped Arrow, or streamed).

A source is a file, a folder of data files, a glob, a folder written by `datasets.Dataset.save_to_disk`, or
a Hub dataset (org/name[@revision][:config[:split]]), read from its snapshot in the huggingface_hub cache.
Read errors name the file and, for JSON lines, the line.
"""

import contextlib
import csv
import json
import logging
from pathlib import Path

import datasets

from llmtune.data.files import is_saved_dataset, resolve_data_files
from llmtune.errors import UserError
from llmtune.hub import HubDataset, dataset_source, fetch

BUILDERS = {
    ".jsonl": ("json", {}),
    ".json": ("json", {}),
    ".parquet": ("parquet", {}),
    ".csv": ("csv", {"keep_default_na": False}),
    ".txt": ("text", {}),
}


def load_source(pattern: str, key: str, streaming: bool = False,
                text_sample_by: str = "line") -> datasets.Dataset | datasets.IterableDataset:
    """All rows of one source, in file order. `text_sample_by`: what one document of a .txt file is (datasets' text
    builder's sample_by: line, paragraph or document)."""
    if hub_source := dataset_source(pattern, key):
        return load_hub_source(hub_source, key, streaming)
    if is_saved_dataset(pattern):
        dataset = datasets.load_from_disk(pattern)
        if isinstance(dataset, datasets.DatasetDict):
            raise UserError(f"{key}: {pattern} holds several splits ({', '.join(dataset)}); point at one split's folder")
        return dataset.to_iterable_dataset() if streaming else dataset
    files = resolve_data_files([pattern], key)
    parts = []
    for builder, group in _group_by_builder(files).items():
        name, options = BUILDERS[builder]
        if builder == ".csv":
            options = {**options, "features": _text_columns(group[0])}
        if builder == ".txt":
            options = {**options, "sample_by": text_sample_by}
        try:
            with _read_errors_said_once(name):
                part = datasets.load_dataset(name, data_files=group, split="train", streaming=streaming, **options)
            parts.append(_without_blank_documents(part) if builder == ".txt" else part)
        except (datasets.exceptions.DatasetGenerationError, UnicodeDecodeError, ValueError) as err:
            raise UserError(_read_error(group, err)) from None
    if len(parts) == 1:
        return parts[0]
    try:
        return datasets.concatenate_datasets(parts)
    except ValueError as err:
        raise UserError(f"{key}: the files of {pattern!r} have different columns ({err}); give each kind its own "
                        "entry") from None


@contextlib.contextmanager
def _read_errors_said_once(builder: str):
    """datasets' reader of `builder` logs the error it fails with before it raises it, JSON's counting rows from 0
    ("in row 7" for line 8); the UserError made of it (_read_error) says it once, the line numbered as editors number
    it. Its warnings still show."""
    logger = logging.getLogger(f"datasets.packaged_modules.{builder}.{builder}")
    logger.addFilter(_below_errors)
    try:
        yield
    finally:
        logger.removeFilter(_below_errors)


def _below_errors(record: logging.LogRecord) -> bool:
    return record.levelno < logging.ERROR


def hub_builder(source: HubDataset, key: str) -> datasets.DatasetBuilder:
    """The datasets builder of a Hub dataset's config, from its snapshot in the cache (fetched before); a config
    or split the dataset does not have is refused. It reads no rows: its config's data files name the splits."""
    folder = fetch(source.repo, key, local_files_only=True)
    try:
        builder = datasets.load_dataset_builder(str(folder), name=source.config)
    except ValueError as err:  # no such config
        raise UserError(f"{key}: {source.repo}: {' '.join(str(err).split())}; write org/name:config") from None
    splits = list(builder.config.data_files or ())
    if source.split not in splits:
        raise UserError(f"{key}: {source.repo} has no split {source.split!r} in its config {builder.config.name!r} "
                        f"(splits: {', '.join(splits)}); write org/name:config:split")
    return builder


def load_hub_source(source: HubDataset, key: str, streaming: bool) -> datasets.Dataset | datasets.IterableDataset:
    builder = hub_builder(source, key)
    if streaming:
        return builder.as_streaming_dataset(split=source.split)
    try:
        builder.download_and_prepare()
    except datasets.exceptions.DatasetGenerationError as err:
        raise UserError(f"{key}: could not read {source.repo}: {' '.join(str(err.__cause__ or err).split())}") from None
    return builder.as_dataset(split=source.split)


def _without_blank_documents(documents):
    """A blank line (or paragraph) is read as a document of no text: it would train a lone EOS (and BOS)."""
    return documents.filter(lambda text: bool(text.strip()), input_columns="text")


def _text_columns(csv_file: str) -> datasets.Features:
    """Every CSV column read as text: a response "0.50" must not become the number 0.5."""
    with open(csv_file, newline="", encoding="utf-8") as f:
        header = next(csv.reader(f), [])
    return datasets.Features({column: datasets.Value("string") for column in header})


def _group_by_builder(files: list[str]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for name in files:
        groups.setdefault(_builder_of(name), []).append(name)
    return groups


def _builder_of(name: str) -> str:
    suffix = Path(name).suffix
    return ".jsonl" if suffix == ".json" else suffix


def undecodable_error(pattern: str, key: str, err: UnicodeDecodeError) -> UserError:
    """Text that is not UTF-8 can pass the reader and fail only when a row is read: name its line."""
    if is_saved_dataset(pattern) or dataset_source(pattern, key):
        return UserError(f"{key}: {pattern} holds text that is not UTF-8 ({err})")
    return UserError(_read_error(resolve_data_files([pattern], key), err))


def _read_error(files: list[str], err: Exception) -> str:
    """Find the first unreadable line (the datasets library names neither file nor line)."""
    for name in files:
        with open(name, "rb") as f:
            for number, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    return f"{name}:{number}: not UTF-8 text; re-encode the file as UTF-8"
                if _builder_of(name) == ".jsonl" and line.strip() and not name.endswith(".json"):
                    try:
                        json.loads(line)
                    except json.JSONDecodeError as bad:
                        return f"{name}:{number}: not valid JSON ({bad.msg}); write one JSON object per line"
    cause = err.__cause__ or err
    return f"could not read {', '.join(files)}: {' '.join(str(cause).split())}"
