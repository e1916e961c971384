"""LLaMA-Factory's template names: the model's own chat template is trained with where it renders LLaMA-Factory's probe
conversations to the ids LLaMA-Factory encodes for the name, and the name is refused where no template llmtune has
does. The tokenizer is a byte-level BPE trained here (tests/helpers.byte_level_tokenizer); its chat template is a
plain ChatML one written here. (Against the real tokenizers and LLaMA-Factory's demo data of ../shared/real:
benchmarks/llamafactory_real.py, docs/from-other-trainers.md.)"""

import pytest

from llmtune.data import lf_templates
from llmtune.data.templates import BUILTIN_TEMPLATES, apply_recipe_template
from llmtune.errors import UserError
from tests.helpers import byte_level_tokenizer

# ChatML with no default system text: what LLaMA-Factory's qwen3_nothink and chatml register.
PLAIN_CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return byte_level_tokenizer(tmp_path_factory.mktemp("plain_chatml"), PLAIN_CHATML)


def test_llamafactorys_encoding_of_its_templates(tokenizer):
    """The text of each turn as LLaMA-Factory's slots write it: the default system text where a conversation has none
    (qwen), the system text fused into the first user turn (gemma), the empty thought before every assistant turn
    (qwen3)."""
    def text(name, messages):
        return tokenizer.decode(lf_templates.encode(lf_templates.TEMPLATES[name], tokenizer, messages))

    one_turn, _, two_turns, _ = lf_templates.PROBES
    assert text("qwen", one_turn) == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                                      "assistant.<|im_end|>\n<|im_start|>user\nHi, how are you?<|im_end|>\n"
                                      "<|im_start|>assistant\nI am fine, thank you.<|im_end|>\n")
    assert text("gemma", [{"role": "system", "content": "Be brief."}, *one_turn]).endswith(
        "<start_of_turn>user\nBe brief.\n\nHi, how are you?<end_of_turn>\n<start_of_turn>model\nI am fine, thank "
        "you.<end_of_turn>\n")
    assert text("qwen3", two_turns).count("<think>\n\n</think>\n\n") == 2


def test_the_models_own_template_is_kept_where_it_renders_as_the_named_one(tokenizer):
    assert lf_templates.resolve("qwen3_nothink", tokenizer, BUILTIN_TEMPLATES) == \
        (PLAIN_CHATML, "the model's own chat template")
    assert lf_templates.resolve("chatml", tokenizer, BUILTIN_TEMPLATES)[0] == PLAIN_CHATML
    assert apply_recipe_template(tokenizer, "llamafactory:qwen3_nothink") == "the model's own chat template"
    assert tokenizer.chat_template == PLAIN_CHATML


def test_a_built_in_that_renders_as_the_named_one_stands_in_for_the_models_own(tmp_path):
    """A Qwen3-style template (an empty thought in the last assistant turn alone) renders neither as LLaMA-Factory's
    qwen3 nor as its qwen3_nothink; llmtune's chatml renders as qwen3_nothink."""
    thinking = PLAIN_CHATML.replace("{{ m.content }}", "{% if m.role == 'assistant' and loop.last %}<think>\n\n</think>"
                                                       "\n\n{% endif %}{{ m.content }}")
    tokenizer = byte_level_tokenizer(tmp_path, thinking)
    assert lf_templates.resolve("qwen3_nothink", tokenizer, BUILTIN_TEMPLATES) == \
        (BUILTIN_TEMPLATES["chatml"], "llmtune's built-in chatml")


# Gemma's own template as its tokenizer ships it, in short: the system text before the first user message, every text
# trimmed.
TRIMMING = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] | trim + "
            "'\\n\\n' %}{% set turns = messages[1:] %}{% else %}{% set system = '' %}{% set turns = messages %}"
            "{% endif %}{% for m in turns %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
            "{{ system if loop.first else '' }}{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}")


def test_a_template_that_trims_is_not_kept_and_the_built_ins_render_as_llamafactory(tmp_path):
    """LLaMA-Factory keeps a text's leading and trailing white space (its kto_en_demo has rows that begin with a
    newline); Gemma's and Llama 3's own templates trim it, so they render those rows otherwise. The white-space probe
    finds it, and the built-ins written as LLaMA-Factory renders gemma and llama3 stand in."""
    tokenizer = byte_level_tokenizer(tmp_path, TRIMMING)
    trimmed, kept = lf_templates.PROBES[-1][0]["content"].strip(), lf_templates.PROBES[-1][0]["content"]
    assert trimmed != kept
    # Alike on the conversations with no white space at their ends: only the last probe tells them apart.
    assert all(tokenizer.apply_chat_template(messages, tokenize=False) ==
               tokenizer.apply_chat_template(messages, chat_template=BUILTIN_TEMPLATES["gemma"], tokenize=False)
               for messages in lf_templates.PROBES[:-1])
    assert lf_templates.resolve("gemma", tokenizer, BUILTIN_TEMPLATES) == (BUILTIN_TEMPLATES["gemma"],
                                                                           "llmtune's built-in gemma")
    assert lf_templates.resolve("llama3", tokenizer, BUILTIN_TEMPLATES) == (BUILTIN_TEMPLATES["llama3"],
                                                                            "llmtune's built-in llama3")


@pytest.mark.parametrize("name, why", [
    ("qwen", "renders conversations differently"),  # its default system text, which the model's template lacks
    ("qwen3", "renders conversations differently"),  # an empty thought in every assistant turn
    ("mistral", "renders conversations differently"),
    ("vicuna", "renders conversations differently"),  # its default system text, run into the first user turn
    ("yi", "llmtune reads LLaMA-Factory's templates alpaca, chatml, deepseek3"),
])
def test_a_template_no_template_here_renders_as_is_refused(tokenizer, name, why):
    with pytest.raises(UserError, match=f"data.chat_template: .*{why}"):
        lf_templates.resolve(name, tokenizer, BUILTIN_TEMPLATES)


@pytest.mark.parametrize("name, builtins, why", [
    # Llama 3's markers on a ChatML tokenizer (Qwen's, as a user tried), with no built-in standing in.
    ("llama3", ["chatml"], "its markers <|end_header_id|>, <|eot_id|>, <|start_header_id|> are no tokens of this "
                           "tokenizer (a template of another family)"),
    # Qwen3's <think>, a token the ChatML tokenizers before it lack.
    ("qwen3", list(BUILTIN_TEMPLATES), "its markers </think>, <think> are no tokens of this tokenizer (a template "
                                       "of another family)"),
    # The default system text qwen writes, which the model's own template does not.
    ("qwen", list(BUILTIN_TEMPLATES), "the model's own renders '<|im_start|>user\\nHi, how are you?<|im_end|' where "
                                      "LLaMA-Factory's qwen has '<|im_start|>system\\nYou are Qwen, created b'"),
])
def test_a_refusal_says_what_differs_and_names_the_templates_that_render_here(tokenizer, name, builtins, why):
    """The refusal said only that the template renders differently, not why nor which name would do."""
    with pytest.raises(UserError) as refused:
        lf_templates.resolve(name, tokenizer, {key: BUILTIN_TEMPLATES[key] for key in builtins})
    assert str(refused.value) == (
        f"data.chat_template: LLaMA-Factory's template {name} renders conversations differently from the model's own "
        f"chat template and from llmtune's built-ins ({', '.join(builtins)}): {why}; name a template that renders "
        f"here as LLaMA-Factory's does (chatml or qwen3_nothink), give chat_template: a .jinja file that renders as "
        f"{name} does, or leave template out to train with the model's own")
