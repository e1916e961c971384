"""Turn a (prompt, response) pair into token ids with the prompt masked out of the loss.

The same function renders the prompt at training and at generation time, so what the model
is asked at inference is token for token what it saw in training.
"""

from llmtune.errors import UserError
from llmtune.loss import IGNORE_INDEX

# Used when the tokenizer carries no chat template (e.g. a bare sentencepiece tokenizer).
BUILTIN_PROMPT = "### Instruction:\n{prompt}\n\n### Response:\n"


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Token ids of the prompt, ending where the model's answer begins."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    return tokenizer(BUILTIN_PROMPT.format(prompt=prompt), add_special_tokens=True)["input_ids"]


def encode_example(tokenizer, prompt: str, response: str) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one exchange; labels are -100 on every prompt token."""
    prompt_ids = encode_prompt(tokenizer, prompt)
    if tokenizer.chat_template:
        input_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}],
            tokenize=True,
            return_dict=False,
        )
        if input_ids[: len(prompt_ids)] != prompt_ids:
            raise UserError(
                "the tokenizer's chat template renders the prompt differently with and without "
                "the answer, so the prompt tokens cannot be masked; use a template whose "
                "generation prompt is a prefix of the full conversation"
            )
    else:
        answer = tokenizer(response, add_special_tokens=False)["input_ids"]
        input_ids = prompt_ids + answer + [tokenizer.eos_token_id]
    labels = [IGNORE_INDEX] * len(prompt_ids) + input_ids[len(prompt_ids):]
    return input_ids, labels
