"""sft: rows in a known format -> (prompt, response) -> ids with the prompt masked by -100."""

import logging

import datasets

from llmtune.data.sources import require_columns
from llmtune.data.templates import encode_example
from llmtune.errors import UserError
from llmtune.loss import IGNORE_INDEX

log = logging.getLogger(__name__)

# Formats this version reads, and the columns that identify them (checked in this order).
COLUMNS = {"alpaca": ("instruction", "output"), "prompt_response": ("prompt", "response")}


def detect_format(rows: datasets.Dataset, requested: str, files: list[str]) -> str:
    if requested not in ("auto", *COLUMNS):
        raise UserError(f"data.format: {requested!r} is not supported for sft in this version; "
                        f"use one of auto, {', '.join(COLUMNS)}")
    if requested != "auto":
        require_columns(rows, COLUMNS[requested], f"data.format {requested}", files)
        return requested
    for name, columns in COLUMNS.items():
        if all(c in rows.column_names for c in columns):
            return name
    raise UserError(f"{', '.join(files)}: cannot tell the sft format from the columns "
                    f"{', '.join(rows.column_names)}; expected {' or '.join('/'.join(c) for c in COLUMNS.values())}")


def prompt_and_response(row: dict, fmt: str) -> tuple[str, str]:
    if fmt == "alpaca":
        extra = row.get("input") or ""
        prompt = f"{row['instruction']}\n\n{extra}" if extra else row["instruction"]
        return prompt, row["output"]
    return row["prompt"], row["response"]


def tokenize_examples(rows: datasets.Dataset, tokenizer, fmt: str, max_seq_len: int) -> datasets.Dataset:
    """input_ids and labels per row; rows longer than max_seq_len are cut at the end (counted), rows
    left with no label token are dropped (counted)."""

    def encode(row):
        input_ids, labels = encode_example(tokenizer, *prompt_and_response(row, fmt))
        return {"input_ids": input_ids[:max_seq_len], "labels": labels[:max_seq_len],
                "truncated": len(input_ids) > max_seq_len}

    encoded = rows.map(encode, remove_columns=rows.column_names, desc="tokenize")
    kept = encoded.filter(lambda row: any(label != IGNORE_INDEX for label in row["labels"][1:]), desc="filter")
    truncated = sum(kept["truncated"])
    if truncated or len(kept) < len(encoded):
        log.warning("sft data: %d of %d samples cut to data.max_seq_len=%d; %d dropped with no response left",
                    truncated, len(encoded), max_seq_len, len(encoded) - len(kept))
    return kept.remove_columns("truncated")
