"""Files of prompts as TRL's prompt-only forms take them, a JSONL `prompt` column (read and tokenized as
data/prompts.py reads grpo's); the completions in the prompt's form; the EOS ids a completion stops at."""

from __future__ import annotations

import json
from pathlib import Path

from llmtune.data.formats import prompt_problem
from llmtune.errors import UserError


def json_lines(path: str | Path):
    """(line number, value) of each line of a JSONL file, blank lines skipped; a line that is not JSON refused,
    naming it."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"{path}: line {number} is not valid JSON ({err.msg}); write one JSON object per "
                                "line") from None


def read_prompt_rows(path: str | Path, limit: int | None = None) -> list[dict]:
    """The rows of a JSONL file of prompts (the first `limit`), each with a string or messages `prompt`; the other
    columns kept for the scorers and the output."""
    rows = []
    for number, row in json_lines(path):
        problem = prompt_problem(row.get("prompt") if isinstance(row, dict) else None)
        if problem:
            raise UserError(f"{path}: line {number}: {problem}")
        rows.append(row)
        if limit is not None and len(rows) == limit:
            break
    if not rows:
        raise UserError(f"{path}: no prompts; write JSONL rows with a 'prompt' column")
    return rows


def completion_value(prompt: str | list[dict], text: str) -> str | list[dict]:
    """A completion in its prompt's form, as TRL hands completions to reward functions: a string, or the assistant's
    message."""
    return text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]


def stop_ids(tokenizer, generation_config) -> list[int]:
    """Every EOS id of the tokenizer and of the model's generation config (a chat model's end of turn is often the
    latter's alone)."""
    ids = [tokenizer.eos_token_id]
    configured = getattr(generation_config, "eos_token_id", None)
    ids += configured if isinstance(configured, list) else [configured]
    return sorted({i for i in ids if i is not None})
