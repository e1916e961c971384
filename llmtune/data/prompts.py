"""grpo's rows: TRL's prompt-only forms, a `prompt` column holding a string (tokenized as it is, as llmtune trains a
text prompt: with the tokenizer's own special tokens) or a list of messages (rendered with the chat template and its
generation prompt) -> its token ids, with the row's other columns kept whole for the reward functions (TRL hands
them the data's columns). The same reading serves the evaluation by generation and `llmtune generate`
(generation/prompts.py)."""

import datasets

from llmtune.data import images
from llmtune.data.formats import PROMPT_ROW
from llmtune.data.sft import KEPT, TOO_LONG
from llmtune.data.templates import render, text_ids, text_prompt_ids
from llmtune.errors import UserError


def prompt_ids(tokenizer, prompt: str | list[dict]) -> list[int]:
    """The token ids a completion of `prompt` follows."""
    if isinstance(prompt, str):
        return text_prompt_ids(tokenizer, prompt)
    return text_ids(tokenizer, render(tokenizer, prompt, add_generation_prompt=True))


def prompt_with_images(tokenizer, prompt: str | list[dict], found: list[str], where: str) -> tuple[list[int], dict]:
    """(the token ids a completion follows, the images' tensors) of a prompt with images (images.reference's): a
    string is a user turn of the chat template, its images before its text where it marks none with <image>;
    messages mark theirs."""
    image_inputs = images.of(tokenizer)
    if image_inputs is None:
        raise UserError(f"{where}: images given to a text model with no vision tower; leave them out, or generate "
                        "from a vision-language model")
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt if images.IMAGE in prompt else images.IMAGE * len(found) + prompt}]
    images.check_count(prompt, found, where)
    ids = prompt_ids(tokenizer, image_inputs.placed(prompt))
    ids, _, blobs = image_inputs.expand(ids, [0] * len(ids), found, where)
    return ids, images.merged(blobs)


def tokenize_prompts(rows: datasets.Dataset, tokenizer, max_length: int, map_kw: dict, source: str) -> datasets.Dataset:
    """Canonical prompts of `source` -> input_ids (the prompt's), the row, and status: a prompt longer than
    `max_length` tokens is dropped (counted as too long); one of no tokens is refused (a completion needs a token to
    follow)."""

    def encode(row, index):
        ids = prompt_ids(tokenizer, row[PROMPT_ROW]["prompt"])
        if not ids:
            raise UserError(f"{source}: row {index + 1}: the prompt has no tokens; give it text, or leave the row out")
        fits = len(ids) <= max_length
        return {"input_ids": ids if fits else [], "status": KEPT if fits else TOO_LONG}

    return rows.map(encode, with_indices=True, **map_kw).select_columns(["input_ids", PROMPT_ROW, "status"])
