"""Prompts as TRL's prompt-only forms take them, a JSONL `prompt` column: a string (tokenized as it is, as llmtune
trains a text prompt: with the tokenizer's own special tokens) or a list of messages (rendered with the chat
template and its generation prompt); their token ids; the completions in the prompt's form; the EOS ids a completion
stops at."""

from __future__ import annotations

import json
from pathlib import Path

from llmtune.data.templates import render, text_ids, text_prompt_ids
from llmtune.errors import UserError


def read_prompt_rows(path: str | Path, limit: int | None = None) -> list[dict]:
    """The rows of a JSONL file of prompts (the first `limit`), each with a string or messages `prompt`; the other
    columns kept for the scorers and the output."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"{path}: line {number} is not valid JSON ({err.msg}); write one JSON object per "
                                "line") from None
            problem = prompt_problem(row.get("prompt") if isinstance(row, dict) else None)
            if problem:
                raise UserError(f"{path}: line {number}: {problem}")
            rows.append(row)
            if limit is not None and len(rows) == limit:
                break
    if not rows:
        raise UserError(f"{path}: no prompts; write JSONL rows with a 'prompt' column")
    return rows


def prompt_problem(prompt) -> str | None:
    """What is wrong with a `prompt` value, or None: TRL's prompt-only forms, a string or a list of messages."""
    if isinstance(prompt, str):
        return None
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                   and isinstance(m.get("content"), str) for m in prompt):
        return None
    return ("'prompt' must be a string or a list of messages ({'role': ..., 'content': ...}), as TRL's "
            "prompt-only datasets hold it")


def prompt_ids(tokenizer, prompt: str | list[dict]) -> list[int]:
    """The token ids a completion of `prompt` follows."""
    if isinstance(prompt, str):
        return text_prompt_ids(tokenizer, prompt)
    return text_ids(tokenizer, render(tokenizer, prompt, add_generation_prompt=True))


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
