"""Exact-match accuracy of greedy answers on a prompt/response JSONL file."""

from __future__ import annotations

import json

import torch

from llmtune.data.collate import pad_token_id
from llmtune.data.templates import apply_recipe_template, encode_prompt
from llmtune.errors import UserError

_BATCH = 64


def _read_rows(eval_file: str, limit: int | None) -> list[dict]:
    rows = []
    with open(eval_file, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{eval_file}: line {lineno} is not valid JSON ({e.msg}); "
                                "write one JSON object per line") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) \
                    or not isinstance(row.get("response"), str):
                raise UserError(f"{eval_file}: line {lineno} needs string fields 'prompt' and "
                                "'response'")
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        raise UserError(f"{eval_file}: no rows to evaluate; add prompt/response lines")
    return rows


@torch.no_grad()
def generate_answers(model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy answers, decoded up to the first eos. Prompts are batched by token length, so
    no batch needs padding and each answer is what the model gives that prompt alone."""
    eos = tokenizer.eos_token_id
    pad = pad_token_id(tokenizer)
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(i)
    answers: list[str] = [""] * len(prompts)
    for length in sorted(by_length):
        idx = by_length[length]
        for start in range(0, len(idx), _BATCH):
            chunk = idx[start:start + _BATCH]
            input_ids = torch.tensor([encoded[i] for i in chunk], dtype=torch.long)
            out = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                num_beams=1,
                eos_token_id=eos,
                pad_token_id=pad,
            )
            for i, row in zip(chunk, out[:, length:].tolist()):
                if eos in row:
                    row = row[: row.index(eos)]
                answers[i] = tokenizer.decode(row, skip_special_tokens=True)
    return answers


def exact_match(model_dir: str, eval_file: str, limit: int | None = None,
                chat_template: str | None = None) -> float:
    """Fraction of rows whose greedy answer, stripped, equals the stripped response.

    Prompts are rendered with the model folder's chat template (an SFT export carries the one
    it was trained with); `chat_template` overrides it, and a tokenizer without any (a
    pre-trained-only model) gets the built-in "basic" one the demo's SFT recipe uses.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = _read_rows(eval_file, limit)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if chat_template or not tokenizer.chat_template:
        apply_recipe_template(tokenizer, chat_template or "basic")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.to("cpu").eval()
    # Room for the longest reference answer and its eos; a longer answer is wrong anyway.
    max_new_tokens = 1 + max(
        len(tokenizer(r["response"], add_special_tokens=False)["input_ids"]) for r in rows
    )
    answers = generate_answers(model, tokenizer, [r["prompt"] for r in rows], max_new_tokens)
    correct = sum(a.strip() == r["response"].strip() for a, r in zip(answers, rows))
    return correct / len(rows)
