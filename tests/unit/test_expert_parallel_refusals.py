"""Expert parallelism's refusals (llmtune/model/expert_parallel.py): a model without experts, or whose experts do
not split evenly over the ranks, gets one line naming the key, the count and the fix. The dispatch itself is tested
on 2 processes (tests/dist/test_expert_parallel.py)."""

import torch
from transformers import AutoModelForCausalLM

from llmtune.model.expert_parallel import expert_parallel_problem, experts_modules
from tests.model_matrix import FAMILIES


def meta_model(name: str):
    family = next(family for family in FAMILIES if family.name == name)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(family.hf_config(vocab_size=64))


def test_the_experts_are_found_by_structure_in_every_moe_family_of_the_matrix():
    for family in FAMILIES:
        found = experts_modules(meta_model(family.name))
        # DeepSeek-V3's first layer is dense (first_k_dense_replace 1).
        assert len(found) == (family.config.get("num_hidden_layers", 2) - (family.name == "DeepSeek-V3")
                              if family.mixture_of_experts else 0), family.name


def test_a_model_without_experts_is_refused():
    problem = expert_parallel_problem(meta_model("Llama-3.x"), 2)
    assert problem == ("parallel.expert_parallel: 2 needs a mixture-of-experts model whose experts use "
                       "transformers' experts implementations; LlamaForCausalLM has none: set it to 1")


def test_experts_that_do_not_split_evenly_are_refused():
    problem = expert_parallel_problem(meta_model("Qwen3-MoE"), 3)
    assert problem == ("parallel.expert_parallel: 3 does not divide the 4 experts of Qwen3MoeForCausalLM's layers; "
                       "use a divisor of 4")


def test_experts_that_split_evenly_pass():
    assert expert_parallel_problem(meta_model("Mixtral"), 2) is None
    assert expert_parallel_problem(meta_model("gpt-oss"), 4) is None
