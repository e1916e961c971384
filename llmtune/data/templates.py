"""Conversations -> token ids, with loss only on the assistant turns.

The chat template is the tokenizer's own, or one named in the recipe (a built-in name or a
.jinja file); a recipe's template is set on the tokenizer, so the exported model carries the
template it was trained with and `apply_chat_template` at inference asks exactly what training
showed. The same prompt rendering serves training and generation.
"""

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from jinja2 import TemplateError
from transformers import AutoTokenizer

from llmtune.data import images, lf_templates
from llmtune.errors import UserError
from llmtune.model.loss import IGNORE_INDEX
from llmtune.tasks.registry import DOCUMENTS, TASKS

log = logging.getLogger(__name__)
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

BUILTIN_TEMPLATES = {
    # An instruction/response layout for tokenizers that ship no template (e.g. bare sentencepiece).
    # Tools are listed after the system text; a tool call is written as JSON after the assistant's text.
    "basic": (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] in ('system', 'developer') %}{{ m['content'] }}\n\n"
        "{% elif m['role'] == 'user' %}{% if tools and loop.index0 <= 1 %}### Tools:\n{{ tools | tojson }}\n\n"
        "{% endif %}### Instruction:\n{{ m['content'] }}\n\n### Response:\n"
        "{% elif m['role'] == 'tool' %}### Tool result:\n{{ m['content'] }}\n\n### Response:\n"
        "{% else %}{{ m['content'] }}{% for call in m.get('tool_calls', []) %}"
        "<tool_call>{{ call['function'] | tojson }}</tool_call>{% endfor %}{{ eos_token }}{% endif %}"
        "{% endfor %}"
    ),
    # ChatML with no default system text, as LLaMA-Factory's chatml and qwen3_nothink render it (lf_templates.py):
    # for a tokenizer whose own template renders otherwise (Qwen3's thinks in its last turn).
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    # Gemma's turns as LLaMA-Factory's gemma renders them: the system text before the first user message, every text
    # as it is (Gemma's own template trims them, which LLaMA-Factory does not).
    "gemma": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\\n\\n' %}"
        "{% set turns = messages[1:] %}{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
        "{% for m in turns %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
        "{{ system if loop.first else '' }}{{ m['content'] }}<end_of_turn>\n{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    ),
    # Llama 3's turns as LLaMA-Factory's llama3 renders them: no date or default system text, every text as it is
    # (Llama 3's own template trims them and, from 3.1, writes a dated system turn).
    "llama3": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
}


def apply_recipe_template(tokenizer, template: str | None) -> str | None:
    """Give the tokenizer the recipe's chat template; refuse to go on without any. A LLaMA-Factory template name
    (llamafactory:NAME) gives the template that renders as it does (lf_templates.resolve); returns where it came
    from, for the log (None otherwise)."""
    if template and template.startswith(lf_templates.PREFIX):
        tokenizer.chat_template, source = lf_templates.resolve(template.removeprefix(lf_templates.PREFIX), tokenizer,
                                                               BUILTIN_TEMPLATES)
        return source
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
    return None


def recipe_tokenizer(task: str, model_cfg, data_cfg):
    """The run's tokenizer: every task but one of documents (pt) renders conversations and needs a chat template; a
    pt recipe may name one too, for the exported model to carry. A vision-language model's carries its image
    processing (data/images.py), found before the recipe's template replaces the model's own."""
    from transformers import AutoConfig

    chat_template = data_cfg.chat_template
    tokenizer = AutoTokenizer.from_pretrained(model_cfg.tokenizer or model_cfg.name_or_path,
                                              trust_remote_code=model_cfg.trust_remote_code)
    model_config = AutoConfig.from_pretrained(model_cfg.name_or_path or model_cfg.config,
                                              trust_remote_code=model_cfg.trust_remote_code)
    images.attach(tokenizer, (model_cfg.name_or_path, model_cfg.tokenizer), model_config, data_cfg)
    if TASKS[task].rows != DOCUMENTS or chat_template:
        source = apply_recipe_template(tokenizer, chat_template)
        if source:
            log.info("data.chat_template: %s renders conversations as LLaMA-Factory's %s does, token for token; "
                     "training with it", source, chat_template.removeprefix(lf_templates.PREFIX))
    return tokenizer


def render(tokenizer, messages: list[dict], add_generation_prompt: bool, tools: list | None = None) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Token ids of a one-turn prompt, ending where the model's answer begins."""
    return text_ids(tokenizer, render(tokenizer, [{"role": "user", "content": prompt}], True))


@dataclass(frozen=True)
class LabelRules:
    """What an sft sample trains on besides the assistant's output, and how messages name the template."""
    train_on_prompt: bool = False
    train_on_reasoning: bool = True
    template: str = "the chat template"

    @classmethod
    def of(cls, data_cfg, tokenizer) -> "LabelRules":
        template = f"data.chat_template {data_cfg.chat_template!r}" if data_cfg.chat_template else \
            f"the chat template of {tokenizer.name_or_path}"
        return cls(data_cfg.train_on_prompt, data_cfg.train_on_reasoning, template)


def has_generation_markers(template: str | None) -> bool:
    return bool(template and GENERATION_TAG.search(template))


def encode_sample(tokenizer, sample: dict, rules: LabelRules, where: str) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of a canonical sft sample (formats.py): a conversation or a text pair."""
    if "messages" not in sample:
        return encode_text_pair(tokenizer, sample["prompt"], sample["completion"], rules)
    messages = [for_template(m) for m in sample["messages"]]
    tools = sample.get("tools")
    # A template that marks what the assistant generates says itself which tokens are trained, for every sample
    # alike; otherwise each assistant turn is found by rendering the conversation up to it.
    encode = _encode_marked if has_generation_markers(tokenizer.chat_template) else _encode_by_prefixes
    try:
        return encode(tokenizer, messages, tools, sample["prompt_turns"], rules, where)
    except TemplateError as err:  # the template's own raise_exception, or a field it needs and the row lacks
        raise UserError(f"{where}: {rules.template} cannot render this conversation ({err}); fix the row, or set "
                        "data.chat_template to a template that takes it") from None


def encode_text_pair(tokenizer, prompt: str, completion: str, rules: LabelRules) -> tuple[list[int], list[int]]:
    """TRL's prompt-completion form with strings: the prompt's ids, then the completion's, which alone are trained;
    no chat template."""
    prompt_ids, completion_ids = text_prompt_ids(tokenizer, prompt), text_completion_ids(tokenizer, completion)
    return prompt_ids + completion_ids, _masked(prompt_ids, rules.train_on_prompt) + completion_ids


def text_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """A prompt string without a chat template, as a pt document begins: with the tokenizer's own special tokens."""
    return tokenizer(prompt)["input_ids"] if prompt else []


def text_completion_ids(tokenizer, completion: str) -> list[int]:
    """A completion string without a chat template: its ids and EOS, so that the model learns to stop."""
    return text_ids(tokenizer, completion) + [tokenizer.eos_token_id]


def for_template(message: dict) -> dict:
    # Templates read an assistant's reasoning under one of two names (Qwen3 and others reasoning_content,
    # gpt-oss thinking); the message carries both, and a template reads the one it knows.
    if "reasoning_content" in message:
        return {**message, "thinking": message["reasoning_content"]}
    return message


def _encode_by_prefixes(tokenizer, messages, tools, prompt_turns: int, rules: LabelRules, where: str):
    """The conversation rendered up to each assistant turn and cut into segments at the turn boundaries; each
    segment is tokenized alone, so a boundary never falls inside a token. Assistant turns of a prompt (TRL's
    prompt-completion) are prompt."""
    input_ids: list[int] = []
    labels: list[int] = []
    done = ""
    for end, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:end], True, tools)
        full = render(tokenizer, messages[:end + 1], False, tools)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise UserError(f"{where}: {rules.template} renders earlier turns differently once later turns are added "
                            f"(seen at message {end}), so the assistant's turns cannot be found by rendering the "
                            f"conversation turn by turn; set data.chat_template to a template that marks each "
                            f"assistant output with {{% generation %}}...{{% endgeneration %}}")
        ids = text_ids(tokenizer, prompt[len(done):])
        input_ids += ids
        labels += _masked(ids, rules.train_on_prompt)
        output = full[len(prompt):]
        reasoning = _reasoning_spans(output, [message], where, rules)
        ids, trained = _trained_ids(tokenizer, output, reasoning if not rules.train_on_reasoning else [])
        input_ids += ids
        labels += trained if end >= prompt_turns else _masked(ids, rules.train_on_prompt)
        done = full
    check_rendered(done, messages, tools, where, rules)
    return input_ids, labels


def _encode_marked(tokenizer, messages, tools, prompt_turns: int, rules: LabelRules, where: str):
    """The conversation rendered once; the tokens inside the template's generation markers are trained."""
    encoded = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True,
                                            tokenizer_kwargs={"return_offsets_mapping": True})
    input_ids = list(encoded["input_ids"])
    labels = [t if trained or rules.train_on_prompt else IGNORE_INDEX
              for t, trained in zip(input_ids, encoded["assistant_masks"])]
    text = render(tokenizer, messages, False, tools)
    check_rendered(text, messages, tools, where, rules)
    if any("reasoning_content" in m for m in messages):
        # A template may leave out the reasoning of earlier turns by design; the last one must be there.
        spans = _reasoning_spans(text, [m for m in messages if "reasoning_content" in m], where, rules, last=True)
        if not rules.train_on_reasoning:
            labels = [IGNORE_INDEX if _inside(offset, spans) else label
                      for offset, label in zip(encoded["offset_mapping"], labels)]
    if prompt_turns:
        prompt_ids = text_ids(tokenizer, render(tokenizer, messages[:prompt_turns], True, tools))
        if input_ids[:len(prompt_ids)] != prompt_ids:
            raise UserError(f"{where}: {rules.template} renders the prompt's turns differently once the completion is "
                            "added, so the completion cannot be told from the prompt")
        labels[:len(prompt_ids)] = _masked(prompt_ids, rules.train_on_prompt)
    return input_ids, labels


def check_rendered(text: str, messages: list[dict], tools: list | None, where: str, rules: LabelRules) -> None:
    """Refuse what a template leaves out rather than train without it: the tools, the tool calls and the tool
    results up to the last assistant turn (after it nothing is rendered) must show in the rendering."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    missing = [f"the tool {name!r} of the tools column" for name in map(_tool_name, tools or []) if name not in text]
    for message in messages[:last + 1]:
        missing += [f"the tool call to {call['function']['name']!r}" for call in message.get("tool_calls", [])
                    if call["function"]["name"] not in text]
        if message["role"] == "tool" and message["content"].strip() not in text:
            missing.append("a tool result (role tool)")
    if missing:
        raise UserError(f"{where}: {rules.template} does not render {missing[0]}; set data.chat_template to a "
                        "template made for tool use")


def _tool_name(tool: dict) -> str:
    return str(tool.get("function", tool).get("name", ""))


def _reasoning_spans(text: str, messages: list[dict], where: str, rules: LabelRules,
                     last: bool = False) -> list[tuple[int, int]]:
    """Character spans of the messages' reasoning in `text`, in order. A reasoning the template does not render
    is refused (every one, or with `last` the last one), rather than dropped silently."""
    spans, cursor = [], 0
    for number, message in enumerate(messages):
        reasoning = message.get("reasoning_content", "").strip()
        start = text.find(reasoning, cursor) if reasoning else -1
        if start >= 0:
            spans.append((start, start + len(reasoning)))
            cursor = start + len(reasoning)
        elif reasoning and (not last or number == len(messages) - 1):
            raise UserError(f"{where}: {rules.template} does not render the assistant's reasoning "
                            f"(reasoning_content / thinking); set data.chat_template to a template that renders it, or "
                            f"remove the reasoning from the data")
    return spans


def _trained_ids(tokenizer, text: str, untrained: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """(ids, labels) of an assistant output; tokens that overlap an untrained character span are not trained."""
    if not untrained:
        ids = text_ids(tokenizer, text)
        return ids, list(ids)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"]
    return ids, [IGNORE_INDEX if _inside(offset, untrained) else t for t, offset in zip(ids, encoded["offset_mapping"])]


def _inside(offset: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    return any(offset[0] < end and offset[1] > start for start, end in spans)


def _masked(ids: list[int], trained: bool) -> list[int]:
    return list(ids) if trained else [IGNORE_INDEX] * len(ids)


def text_ids(tokenizer, text: str) -> list[int]:
    # Special tokens appear as text in the rendering (e.g. {{ bos_token }}): add none twice.
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
