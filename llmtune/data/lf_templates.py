"""LLaMA-Factory's chat templates by name (a flat recipe's `template`, data.chat_template `llamafactory:NAME`), held
as its data/template.py registers them. llmtune never trains with a rendering of its own of them: it trains with the
model's own chat template, or a llmtune built-in, where that renders LLaMA-Factory's probe conversations (PROBES: a
turn, a system text, two turns) to the same token ids as LLaMA-Factory encodes them; where none does, the run is
refused, saying why (the template's markers that are no tokens of the tokenizer, else where the model's own template
first renders otherwise) and naming what to set (the names that do render here). Encoding as LLaMA-Factory does
(Template._encode, encode_multiturn): the prefix and the system text before the first turn (its default system where
a conversation has none; Llama2Template's fuse it into the first user turn), each formatted turn tokenized alone
without special tokens, its {"bos_token"} and {"eos_token"} slots the tokenizer's ids; a ReasoningTemplate (qwen3)
puts the empty thought before every assistant turn that has none.
"""

import re
from dataclasses import dataclass

from llmtune.errors import UserError
from llmtune.llamafactory import LF_TEMPLATE as PREFIX
BOS, EOS = "bos_token", "eos_token"  # the slots LLaMA-Factory writes as {"bos_token"}, {"eos_token"}
CHATML_USER = ("<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n",)
CHATML_ASSISTANT = ("{{content}}<|im_end|>\n",)
CHATML_SYSTEM = ("<|im_start|>system\n{{content}}<|im_end|>\n",)
# A marker as the families write them: <|eot_id|>, <start_of_turn>, </SYS>, <｜User｜>.
MARKER = re.compile(r"<[^<>\s{}]+>")


@dataclass(frozen=True)
class LFTemplate:
    user: tuple = ("{{content}}",)
    assistant: tuple = ("{{content}}", EOS)
    system: tuple = ("{{content}}",)  # register_template's default: the text alone
    prefix: tuple = ()
    default_system: str = ""
    fuse_system: bool = False  # Llama2Template: the system text joins the first user message
    thought: str | None = None  # ReasoningTemplate: the empty thought put before an assistant turn without one


GEMMA = LFTemplate(user=("<start_of_turn>user\n{{content}}<end_of_turn>\n<start_of_turn>model\n",),
                  assistant=("{{content}}<end_of_turn>\n",), system=("{{content}}\n\n",), prefix=(BOS,),
                  fuse_system=True)

# register_template's arguments of LLaMA-Factory's data/template.py (main branch, August 2026) for the names its
# examples use and those of the families llmtune trains, their text alone (no tools, no images).
TEMPLATES = {
    "alpaca": LFTemplate(user=("### Instruction:\n{{content}}\n\n### Response:\n",),
                         assistant=("{{content}}", EOS, "\n\n"),
                         default_system="Below is an instruction that describes a task. Write a response that "
                                        "appropriately completes the request.\n\n"),
    "chatml": LFTemplate(user=CHATML_USER, assistant=CHATML_ASSISTANT, system=CHATML_SYSTEM),
    "deepseek3": LFTemplate(user=("<｜User｜>{{content}}<｜Assistant｜>",), prefix=(BOS,)),
    "default": LFTemplate(user=("Human: {{content}}", EOS, "\nAssistant:"), assistant=("{{content}}", EOS, "\n"),
                          system=("System: {{content}}", EOS, "\n")),
    "empty": LFTemplate(assistant=("{{content}}",)),
    "gemma": GEMMA,
    "gemma3": GEMMA,  # gemma's text, with Gemma 3's image plugin
    "llama2": LFTemplate(user=(BOS, "[INST] {{content}} [/INST]"), system=("<<SYS>>\n{{content}}\n<</SYS>>\n\n",),
                         fuse_system=True),
    "llama3": LFTemplate(user=("<|start_header_id|>user<|end_header_id|>\n\n{{content}}<|eot_id|>"
                               "<|start_header_id|>assistant<|end_header_id|>\n\n",),
                         assistant=("{{content}}<|eot_id|>",),
                         system=("<|start_header_id|>system<|end_header_id|>\n\n{{content}}<|eot_id|>",),
                         prefix=(BOS,)),
    "llama4": LFTemplate(user=("<|header_start|>user<|header_end|>\n\n{{content}}<|eot|>"
                               "<|header_start|>assistant<|header_end|>\n\n",),
                         assistant=("{{content}}<|eot|>",),
                         system=("<|header_start|>system<|header_end|>\n\n{{content}}<|eot|>",), prefix=(BOS,)),
    "mistral": LFTemplate(user=("[INST] {{content}}[/INST]",), assistant=(" {{content}}", EOS),
                          system=("{{content}}\n\n",), prefix=(BOS,), fuse_system=True),
    "phi": LFTemplate(user=("<|user|>\n{{content}}<|end|>\n<|assistant|>\n",), assistant=("{{content}}<|end|>\n",),
                      system=("<|system|>\n{{content}}<|end|>\n",)),
    "phi4": LFTemplate(user=("<|im_start|>user<|im_sep|>{{content}}<|im_end|><|im_start|>assistant<|im_sep|>",),
                       assistant=("{{content}}<|im_end|>",),
                       system=("<|im_start|>system<|im_sep|>{{content}}<|im_end|>",)),
    "phi4_mini": LFTemplate(user=("<|user|>{{content}}<|end|><|assistant|>",), assistant=("{{content}}<|end|>",),
                            system=("<|system|>{{content}}<|end|>",)),
    "qwen": LFTemplate(user=CHATML_USER, assistant=CHATML_ASSISTANT, system=CHATML_SYSTEM,
                       default_system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
    "qwen3": LFTemplate(user=CHATML_USER, assistant=CHATML_ASSISTANT, system=CHATML_SYSTEM,
                        thought="<think>\n\n</think>\n\n"),
    "qwen3_nothink": LFTemplate(user=CHATML_USER, assistant=CHATML_ASSISTANT, system=CHATML_SYSTEM),
    # The vision-language ones: their text as above, their images the model's own placeholder (data/images.py), as
    # LLaMA-Factory's qwen2_vl and qwen3_vl plugins write it.
    "qwen2_vl": LFTemplate(user=CHATML_USER, assistant=CHATML_ASSISTANT, system=CHATML_SYSTEM,
                           default_system="You are a helpful assistant."),
    "qwen3_vl": LFTemplate(user=CHATML_USER, assistant=CHATML_ASSISTANT, system=CHATML_SYSTEM,
                           thought="<think>\n\n</think>\n\n"),
    "qwen3_vl_nothink": LFTemplate(user=CHATML_USER, assistant=CHATML_ASSISTANT, system=CHATML_SYSTEM),
    "vicuna": LFTemplate(user=("USER: {{content}} ASSISTANT:",),
                         default_system="A chat between a curious user and an artificial intelligence assistant. "
                                        "The assistant gives helpful, detailed, and polite answers to the user's "
                                        "questions."),
}
# The names of vision-language models' templates: read where a recipe names them, never offered for a text model (their
# text is a text template's).
VISION_TEMPLATES = frozenset({"qwen2_vl", "qwen3_vl", "qwen3_vl_nothink"})
# LLaMA-Factory's demo conversations, in the forms a template renders differently: one turn, a system text, two turns,
# and texts that begin and end in white space (its kto_en_demo has them), which LLaMA-Factory keeps and some models'
# own templates trim (Gemma's, Llama 3's).
PROBES = (
    [{"role": "user", "content": "Hi, how are you?"}, {"role": "assistant", "content": "I am fine, thank you."}],
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "What is 2 + 3?"},
     {"role": "assistant", "content": "2 + 3 = 5."}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "And another one?"}, {"role": "assistant", "content": "Green."}],
    [{"role": "user", "content": "\nQ: Is the sky blue?\nA: "}, {"role": "assistant", "content": "Yes, it is. "}],
)


def encode(template: LFTemplate, tokenizer, messages: list[dict]) -> list[int]:
    """A conversation's token ids as LLaMA-Factory encodes it with `template`."""
    system = messages[0]["content"] if messages[0]["role"] == "system" else template.default_system
    turns = messages[1:] if messages[0]["role"] == "system" else messages
    ids = []
    for i, message in enumerate(turns):
        slots, content = [], message["content"]
        if i == 0:
            slots += template.prefix
            if system and template.fuse_system:
                content = _filled(template.system, system)[0] + content
            elif system:
                slots += _filled(template.system, system)
        if message["role"] == "user":
            slots += _filled(template.user, content)
        else:
            if template.thought is not None and "<think>" not in content:
                slots.append(tokenizer.encode(template.thought, add_special_tokens=False))
            slots += _filled(template.assistant, content)
        ids += _ids(tokenizer, slots)
    return ids


def _filled(slots: tuple, content: str) -> list:
    return [slot.replace("{{content}}", content) if slot not in (BOS, EOS) else slot for slot in slots]


def _ids(tokenizer, slots: list) -> list[int]:
    ids = []
    for slot in slots:
        if isinstance(slot, list):  # a ReasoningTemplate's thought, tokenized alone
            ids += slot
        elif slot == BOS:
            ids += [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        elif slot == EOS:
            ids += [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        elif slot:
            ids += tokenizer.encode(slot, add_special_tokens=False)
    return ids


def difference(name: str, tokenizer, chat_template: str) -> str | None:
    """Where `chat_template` (Jinja) renders a probe conversation otherwise than LLaMA-Factory encodes it with
    template `name`, for a message; None where it renders every probe to LLaMA-Factory's ids."""
    for messages in PROBES:
        text = tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False)
        expected = encode(TEMPLATES[name], tokenizer, messages)
        if tokenizer(text, add_special_tokens=False)["input_ids"] == expected:
            continue
        encoded = tokenizer.decode(expected)
        if encoded == text:
            return "the same text in other tokens (LLaMA-Factory tokenizes each piece of a turn alone)"
        at = next((i for i, (a, b) in enumerate(zip(text, encoded)) if a != b), min(len(text), len(encoded)))
        start = max(0, at - 20)
        return f"{text[start:at + 30]!r} where LLaMA-Factory's {name} has {encoded[start:at + 30]!r}"
    return None


def _missing_markers(template: LFTemplate, tokenizer) -> list[str]:
    """The markers `template` writes (<|eot_id|>, <start_of_turn>, ...) that are no token of `tokenizer`: a template of
    another family, whose markers this tokenizer cuts into pieces of text."""
    slots = (*template.prefix, *template.system, *template.user, *template.assistant, template.thought or "")
    vocabulary = tokenizer.get_vocab()
    return sorted({marker for slot in slots if slot not in (BOS, EOS) for marker in MARKER.findall(slot)
                   if marker not in vocabulary})


def _fitting(tokenizer, candidates: list[tuple[str, str]]) -> list[str]:
    """LLaMA-Factory's template names that one of `candidates` ((where from, Jinja)) renders as it does with
    `tokenizer`, its markers the tokenizer's own tokens."""
    return [name for name, template in TEMPLATES.items() if name not in VISION_TEMPLATES
            and not _missing_markers(template, tokenizer)
            and any(difference(name, tokenizer, jinja) is None for _, jinja in candidates)]


def resolve(name: str, tokenizer, builtins: dict[str, str]) -> tuple[str, str]:
    """(the Jinja chat template that renders as LLaMA-Factory's `name` does, where it comes from): the tokenizer's
    own, else a llmtune built-in; UserError where none does."""
    if name not in TEMPLATES:
        raise UserError(f"data.chat_template: {PREFIX}{name}: llmtune reads LLaMA-Factory's templates "
                        f"{', '.join(TEMPLATES)}; give chat_template (a template llmtune has, or a .jinja file), or "
                        "leave template out for the model's own chat template")
    candidates = ([("the model's own chat template", tokenizer.chat_template)] if tokenizer.chat_template else []) + \
        [(f"llmtune's built-in {key}", jinja) for key, jinja in builtins.items()]
    for source, jinja in candidates:
        if difference(name, tokenizer, jinja) is None:
            return jinja, source
    raise UserError(f"data.chat_template: LLaMA-Factory's template {name} renders conversations differently from "
                    f"the model's own chat template{' (it has none)' if not tokenizer.chat_template else ''} and from "
                    f"llmtune's built-ins ({', '.join(builtins)}){_why(name, tokenizer, builtins)}; "
                    f"{_others(tokenizer, candidates)}give chat_template: a .jinja file that renders as {name} does, "
                    "or leave template out to train with the model's own")


def _why(name: str, tokenizer, builtins: dict[str, str]) -> str:
    """What tells `name` apart here, for its refusal: its markers the tokenizer lacks, else where the model's own
    chat template (without one, llmtune's built-in of the name) first renders otherwise."""
    if missing := _missing_markers(TEMPLATES[name], tokenizer):
        return f": its markers {', '.join(missing)} are no tokens of this tokenizer (a template of another family)"
    if jinja := tokenizer.chat_template or builtins.get(name):
        whose = "the model's own" if tokenizer.chat_template else f"llmtune's {name}"
        return f": {whose} renders {difference(name, tokenizer, jinja)}"
    return ""


def _others(tokenizer, candidates: list[tuple[str, str]]) -> str:
    """The refusal's first fix: the names that do render here, where some do."""
    names = _fitting(tokenizer, candidates)
    return f"name a template that renders here as LLaMA-Factory's does ({' or '.join(names)}), " if names else ""
