"""dpo: canonical pairs (formats.py) -> a prompt and two responses in token ids -> one row of two sequences, the
pair limits applied. kto's examples become the same rows (unpaired.py): the example's completion as the chosen
response, its KL completion as the rejected one.

A row holds prompt + chosen, then prompt + rejected (chosen always first), position_ids restarting at 0 for each
sequence and labels on the responses alone (and, as packing.concatenate's convention, never on a sequence's first
token), so that the collator can number the sequences and the objective tell chosen (even) from rejected (odd).
Preference training never trains the prompt: data.train_on_prompt and data.train_on_reasoning are sft's, not read
here.
"""

from dataclasses import dataclass

import datasets
from jinja2 import TemplateError

from llmtune.config import pair_length
from llmtune.data import images
from llmtune.data.formats import MARGIN
from llmtune.data.packing import concatenate
from llmtune.data.sft import KEPT, NO_LABELS, TOO_LONG, TRUNCATED
from llmtune.data.templates import (LabelRules, check_rendered, for_template, render, text_completion_ids, text_ids,
                                    text_prompt_ids)
from llmtune.errors import UserError
from llmtune.model.loss import IGNORE_INDEX
from llmtune.tasks.registry import PAIRS, TASKS, UNPAIRED

RESPONSES = ("chosen", "rejected")
# What messages call a KTO row's two responses: the example's completion and its KL completion, another example's.
KL_RESPONSES = ("example's", "KL")
# The rows built as pairs, each row two sequences of one prompt: dpo's pairs, kto's examples with their KL completion.
TWO_SEQUENCE_ROWS = {PAIRS: RESPONSES, UNPAIRED: KL_RESPONSES}
# The columns of a pair's row, before packing puts several pairs in one.
PAIR_COLUMNS = ["input_ids", "labels", "position_ids"]


def two_sequence_rows(task: str) -> bool:
    """Whether the task's rows each hold two sequences of one prompt, built as pairs."""
    return TASKS[task].rows in TWO_SEQUENCE_ROWS


@dataclass(frozen=True)
class PairLimits:
    """What bounds a pair's sequences (the task's section: dpo's, kto's; PreferenceConfig's help says the policy),
    and what messages call that section and the two responses. They change the rows, so they are part of the cache
    key of a task whose rows are built as pairs."""
    max_length: int  # tokens of prompt + response, for each response
    max_prompt_length: int | None
    truncation: bool
    section: str = "dpo"
    names: tuple[str, str] = RESPONSES

    @classmethod
    def of(cls, config) -> "PairLimits | None":
        """The recipe's limits when its task's rows are built as pairs, else None."""
        if not two_sequence_rows(config.task):
            return None
        preference = config.preference()
        return cls(pair_length(config), preference.max_prompt_length, preference.truncation, preference.section,
                   TWO_SEQUENCE_ROWS[TASKS[config.task].rows])


def encode_pair(tokenizer, pair: dict, rules: LabelRules, where: str,
                names: tuple[str, str]) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen ids, rejected ids) of a canonical pair; `names`: what messages call the two responses."""
    return _encode_responses(tokenizer, pair["prompt"], [pair[key] for key in RESPONSES], names, pair.get("tools"),
                             rules, where)


def sequence_ids(tokenizer, prompt: str | list[dict], response: str | list[dict], rules: LabelRules, where: str,
                 tools: list | None = None) -> list[int]:
    """prompt + response in token ids, as one sequence of a pair's row holds them (before the pair's limits): how
    `llmtune score` and grpo's reward model (generation/reward_model.py) render what they score, so that a model
    trained by `llmtune rm` scores it as its training did."""
    prompt_ids, response_ids = _encode_responses(tokenizer, prompt, [response], ("scored",), tools, rules, where)
    return prompt_ids + response_ids


def _encode_responses(tokenizer, prompt: str | list[dict], responses: list, names: tuple[str, ...], tools,
                      rules: LabelRules, where: str) -> tuple[list[int], ...]:
    """(prompt ids, each response's ids) of one prompt; `names`: what messages call the responses. Strings are
    tokenized as sft's text pairs are (templates.encode_text_pair), without a chat template."""
    if isinstance(prompt, str):
        return (text_prompt_ids(tokenizer, prompt), *(text_completion_ids(tokenizer, r) for r in responses))
    prompt = [for_template(m) for m in prompt]
    try:
        prompt_ids = text_ids(tokenizer, render(tokenizer, prompt, True, tools))
        return (prompt_ids, *(_response_ids(tokenizer, prompt, prompt_ids, response, name, tools, rules, where)
                              for response, name in zip(responses, names)))
    except TemplateError as err:  # the template's own raise_exception, or a field it needs and the row lacks
        raise UserError(f"{where}: {rules.template} cannot render this {'pair' if len(responses) == 2 else 'row'} "
                        f"({err}); fix the row, or set data.chat_template to a template that takes it") from None


def _response_ids(tokenizer, prompt: list[dict], prompt_ids: list[int], response: list[dict], name: str, tools,
                  rules: LabelRules, where: str) -> list[int]:
    """The ids the response adds to the prompt's: the whole conversation rendered and tokenized, less the prompt's
    ids, which must begin it token for token, or the response would be scored on tokens that are not its own."""
    messages = prompt + [for_template(m) for m in response]
    text = render(tokenizer, messages, False, tools)
    check_rendered(text, messages, tools, where, rules)
    full = text_ids(tokenizer, text)
    differ = next((i for i, (a, b) in enumerate(zip(prompt_ids, full)) if a != b), min(len(prompt_ids), len(full)))
    if differ < len(prompt_ids):
        found = _quoted_token(tokenizer, full[differ]) if differ < len(full) else "the end of the rendering"
        raise UserError(f"{where}: {rules.template} renders the prompt differently once the {name} response follows "
                        f"it: token {differ} of the prompt (rendered with add_generation_prompt) is "
                        f"{_quoted_token(tokenizer, prompt_ids[differ])}, of the prompt + {name} {found}, so the "
                        f"response cannot be told from the prompt; set data.chat_template to a template whose prompt "
                        f"rendering begins the whole conversation's")
    if len(full) == len(prompt_ids):
        raise UserError(f"{where}: {rules.template} renders nothing of the {name} response; set data.chat_template "
                        "to a template that renders the assistant's turns")
    return full[len(prompt_ids):]


def _quoted_token(tokenizer, token_id: int) -> str:
    """A token as a message quotes it: its text, or its name in the vocabulary where the text is empty (a
    sentencepiece tokenizer decodes a lone '▁', the space a template adds before the answer, to nothing)."""
    return repr(tokenizer.decode([token_id]) or tokenizer.convert_ids_to_tokens(token_id))


def fit_pair(prompt: list[int], chosen: list[int], rejected: list[int], limits: PairLimits,
             where: str) -> tuple[int, list[int], list[int], list[int]]:
    """(status, prompt, chosen, rejected) within the limits: the prompt keeps its last max_prompt_length tokens; then,
    when prompt + the longer response exceeds max_length, with truncation the prompt keeps its last max(max_length -
    longer response, max_length // 2) tokens and each response its first max_length - prompt tokens, without it the
    pair is refused."""
    status, length, section = KEPT, limits.max_length, limits.section
    if limits.max_prompt_length is not None and len(prompt) > limits.max_prompt_length:
        prompt, status = prompt[-limits.max_prompt_length:], TRUNCATED
    longer = max(len(chosen), len(rejected))
    if len(prompt) + longer > length:
        if not limits.truncation:
            first, second = limits.names
            raise UserError(f"{where}: the prompt ({len(prompt)} tokens) and the longer response ({longer} tokens; "
                            f"{first} {len(chosen)}, {second} {len(rejected)}) make a sequence of "
                            f"{len(prompt) + longer} tokens, over the {length} of {section}.max_length (default "
                            f"data.max_seq_len / 2); raise {section}.max_length (and data.max_seq_len, which holds "
                            f"two), set {section}.max_prompt_length, or set {section}.truncation: true to cut it")
        prompt = prompt[-max(length - longer, length // 2):]
        room = length - len(prompt)
        chosen, rejected, status = chosen[:room], rejected[:room], TRUNCATED
    return status, prompt, chosen, rejected


def pair_row(prompt: list[int], chosen: list[int], rejected: list[int]) -> dict[str, list[int]]:
    """input_ids, labels and position_ids of one pair: prompt + chosen, then prompt + rejected."""
    untrained = [IGNORE_INDEX] * len(prompt)
    return concatenate([(prompt + chosen, untrained + chosen), (prompt + rejected, untrained + rejected)])


def fitted_pair_row(tokenizer, pair: dict, rules: LabelRules, limits: PairLimits, where: str) -> dict:
    """A canonical pair -> its row (pair_row) within the limits and its status: KEPT, TRUNCATED, or NO_LABELS when a
    sequence would train no token (a one-token response after an empty prompt); for a vision-language model, the
    blobs of its prompt's images, once for each sequence (images.IMAGES). A prompt with images is never cut (its
    image tokens would go, their pixels not): such a pair over the limits is TOO_LONG, dropped."""
    found, image_inputs = images.sample_images(pair), images.of(tokenizer)
    if found and image_inputs is None:
        raise images.no_vision_tower(where, "pair")
    if found:
        pair = {**pair, "prompt": image_inputs.placed(pair["prompt"])}
    prompt, chosen, rejected = encode_pair(tokenizer, pair, rules, where, limits.names)
    blobs = []
    if found:
        prompt, _, blobs = image_inputs.expand(prompt, [IGNORE_INDEX] * len(prompt), found, where)
    status, kept, chosen, rejected = fit_pair(prompt, chosen, rejected, limits, where)
    if blobs and len(kept) < len(prompt):
        status, blobs = TOO_LONG, []
    if not all(len(kept) + len(response) > 1 for response in (chosen, rejected)):
        status = NO_LABELS
    return {**pair_row(kept, chosen, rejected), "status": status,
            **({images.IMAGES: blobs * 2} if image_inputs else {})}


def tokenize_pairs(rows: datasets.Dataset, tokenizer, data_cfg, limits: PairLimits, map_kw: dict,
                   source: str) -> datasets.Dataset:
    """Canonical rows ({"pair"}) of `source` -> one row per pair, its status (fitted_pair_row) and its margin, one
    value per sequence."""
    rules = LabelRules.of(data_cfg, tokenizer)

    def encode(row, index):
        pair = row["pair"]
        return {**fitted_pair_row(tokenizer, pair, rules, limits, f"{source}: row {index + 1}"),
                MARGIN: [pair.get(MARGIN, 0.0)] * 2}

    columns = [*PAIR_COLUMNS, "status", MARGIN] + ([images.IMAGES] if images.of(tokenizer) else [])
    features = None
    if images.of(tokenizer):
        features = datasets.Features({**rows.features, **{name: datasets.List(datasets.Value("int64"))
                                                          for name in PAIR_COLUMNS},
                                      "status": datasets.Value("int64"), MARGIN: datasets.List(datasets.Value("float64")),
                                      **images.column_features()})
    return rows.map(encode, with_indices=True, features=features, **map_kw).select_columns(columns)
