"""LLaMA-Factory's template names: the model's own chat template is trained with where it renders LLaMA-Factory's probe
conversations to the ids LLaMA-Factory encodes for the name, and the name is refused where no template llmtune has
does. The tokenizer is a byte-level BPE trained here (tests/helpers.byte_level_tokenizer); its chat template is a
plain ChatML one written here. (Against real tokenizers, measured once: Qwen2.5's template renders as LLaMA-Factory's
qwen, Gemma-3's as its gemma; Qwen3-4B's as neither qwen3 nor qwen3_nothink, whose multi-turn renderings differ.)"""

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

    one_turn, _, two_turns = lf_templates.PROBES
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


@pytest.mark.parametrize("name, why", [
    ("qwen", "renders conversations differently"),  # its default system text, which the model's template lacks
    ("qwen3", "renders conversations differently"),  # an empty thought in every assistant turn
    ("llama3", "renders conversations differently"),
    ("vicuna", "llmtune reads LLaMA-Factory's templates alpaca, chatml"),
])
def test_a_template_no_template_here_renders_as_is_refused(tokenizer, name, why):
    with pytest.raises(UserError, match=f"data.chat_template: .*{why}"):
        lf_templates.resolve(name, tokenizer, BUILTIN_TEMPLATES)
