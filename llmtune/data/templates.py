"""Conversations -> token ids, with loss only on the assistant turns.

The chat template is the tokenizer's own, or one named in the recipe (a built-in name or a
.jinja file); a recipe's template is set on the tokenizer, so the exported model carries the
template it was trained with and `apply_chat_template` at inference asks exactly what training
showed. The same prompt rendering serves training and generation.
"""

from pathlib import Path

from llmtune.errors import UserError
from llmtune.loss import IGNORE_INDEX

BUILTIN_TEMPLATES = {
    # An instruction/response layout for tokenizers that ship no template (e.g. bare sentencepiece).
    "basic": (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
        "{% elif m['role'] == 'user' %}### Instruction:\n{{ m['content'] }}\n\n### Response:\n"
        "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}"
        "{% endfor %}"
    ),
}


def apply_recipe_template(tokenizer, template: str | None) -> None:
    """Give the tokenizer the recipe's chat template; refuse to go on without any."""
    if template in BUILTIN_TEMPLATES:
        tokenizer.chat_template = BUILTIN_TEMPLATES[template]
    elif template:
        if not Path(template).is_file():
            raise UserError(f"data.chat_template: {template!r} is neither a built-in template "
                            f"({', '.join(BUILTIN_TEMPLATES)}) nor a .jinja file")
        tokenizer.chat_template = Path(template).read_text()
    elif not tokenizer.chat_template:
        raise UserError("data.chat_template: the tokenizer has no chat template; set data.chat_template to "
                        f"a built-in one ({', '.join(BUILTIN_TEMPLATES)}) or to a .jinja file")


def render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Token ids of a one-turn prompt, ending where the model's answer begins."""
    return _ids(tokenizer, render(tokenizer, [{"role": "user", "content": prompt}], True))


def encode_conversation(tokenizer, messages: list[dict], train_on_prompt: bool) -> tuple[list[int], list[int]]:
    """(input_ids, labels): every token outside an assistant turn is -100 unless train_on_prompt.

    The conversation is rendered up to each assistant turn and cut into segments at the turn
    boundaries; each segment is tokenized alone, so a boundary never falls inside a token.
    """
    input_ids: list[int] = []
    labels: list[int] = []
    done = ""
    for end, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:end], add_generation_prompt=True)
        full = render(tokenizer, messages[:end + 1], add_generation_prompt=False)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise UserError("data.chat_template: the template renders earlier turns differently once later turns "
                            "are added, so assistant turns cannot be located; use a template whose renderings "
                            "of a conversation's prefixes are prefixes of each other")
        for text, trained in ((prompt[len(done):], train_on_prompt), (full[len(prompt):], True)):
            ids = _ids(tokenizer, text)
            input_ids += ids
            labels += ids if trained else [IGNORE_INDEX] * len(ids)
        done = full
    return input_ids, labels


def _ids(tokenizer, text: str) -> list[int]:
    # Special tokens appear as text in the rendering (e.g. {{ bos_token }}): add none twice.
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
