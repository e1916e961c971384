"""The adapters' pieces against peft itself, on unsharded CPU models: the merge (LoRA, DoRA, rslora, GPT-2's
transposed Conv1D layers) equals peft's merge_and_unload; the adapter keys are those PeftModel.save_pretrained
writes; the recipe's peft section and freezing patterns are checked, and targets that reach a mixture-of-experts
layer's stacked experts refused."""

import copy
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model, inject_adapter_in_model
from peft.utils import get_peft_model_state_dict
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig

from llmtune.config import PeftConfig, TrainConfig
from llmtune.features.adapters import ADAPTER, Adapters, lora_layers, merge_adapters, peft_key
from llmtune.features.freezing import trainable_names


def tiny(kind: str):
    torch.manual_seed(0)
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32))
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def trained_adapters(kind: str, **options):
    """A model with adapters whose every parameter (DoRA's magnitudes too) moved away from its initial value."""
    model = tiny(kind)
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                                       **options), model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.add_(0.1 * torch.randn_like(param))
    return model


@pytest.mark.parametrize("kind, options", [("llama", {}), ("llama", {"use_dora": True}),
                                           ("llama", {"use_rslora": True}), ("gpt2", {}), ("gpt2", {"use_dora": True})])
def test_merge_equals_peft_merge_and_unload(kind, options):
    model = trained_adapters(kind, **options)
    expected = copy.deepcopy(model)
    for layer in lora_layers(expected).values():
        layer.merge()
    merge_adapters(model)
    assert not lora_layers(model)
    merged = dict(model.named_parameters())
    for name, layer in lora_layers(expected).items():
        torch.testing.assert_close(merged[f"{name}.weight"], layer.get_base_layer().weight, rtol=0, atol=1e-6)
    ids = torch.randint(0, 64, (1, 12))
    model.eval(), expected.eval()  # GPT-2 ships with dropout
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected(ids).logits, rtol=0, atol=1e-5)


def test_adapter_keys_are_those_peft_saves():
    model = get_peft_model(tiny("llama"), LoraConfig(r=4, target_modules="all-linear", use_dora=True))
    saved = set(get_peft_model_state_dict(model))
    ours = {peft_key(name) for name, param in model.base_model.model.named_parameters() if param.requires_grad}
    assert ours == saved and any(key.endswith(".lora_magnitude_vector") for key in ours)
    assert all(f".{ADAPTER}." not in key for key in ours)


def test_freezing_patterns_select_by_search():
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
             "model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight", "lm_head.weight"]
    assert trainable_names(names, [r"self_attn\."], [r"layers\.0\."]) == {"model.layers.1.self_attn.q_proj.weight"}
    assert trainable_names(names, None, ["embed", "lm_head"]) == set(names[1:4])
    assert trainable_names(names, None, []) == set(names)
    assert trainable_names(names, [], []) == set()


@pytest.mark.parametrize("changes, problem", [
    ({"method": "ia3"}, "peft.method: 'ia3' is not valid"),
    ({"r": 0}, "peft.r: 0 must be a positive rank"),
    ({"dropout": 1.0}, "peft.dropout: 1.0 must be in [0, 1)"),
    ({"init_lora_weights": "pissa"}, "peft.init_lora_weights: 'pissa' is not supported"),
])
def test_peft_section_problems(changes, problem):
    problems = PeftConfig(**{"method": "lora", **changes}).problems()
    assert len(problems) == 1 and problems[0].startswith(problem)


def test_a_pattern_that_is_not_a_regular_expression_is_named():
    problems = TrainConfig(output_dir="out", trainable_modules=["layers.(0"]).problems()
    assert len(problems) == 1 and problems[0].startswith("train.trainable_modules: 'layers.(0' is not a regular")


MOE = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)


def test_lora_reaching_the_stacked_experts_is_refused_in_one_line_and_attention_targets_pass():
    """peft's all-linear reaches a mixture-of-experts layer's stacked experts and router (its ParamWrapper), which
    llmtune's adapters cannot train: one line naming them and the linear layers to adapt instead."""
    def lora(targets):
        return SimpleNamespace(train=TrainConfig(output_dir="out"), peft=PeftConfig(method="lora",
                                                                                   target_modules=targets),
                               model=SimpleNamespace(trust_remote_code=False), head=lambda: "lm")

    assert Adapters.check(lora("all-linear"), MOE, 1) == [
        "peft.target_modules: 'all-linear' reaches experts, gate of Qwen3MoeForCausalLM's mixture-of-experts layers, "
        "whose stacked parameters peft adapts in a form llmtune cannot train yet; name the linear layers to adapt "
        "(k_proj, o_proj, q_proj, v_proj)"]
    assert Adapters.check(lora(["q_proj", "k_proj", "v_proj", "o_proj"]), MOE, 1) == []
