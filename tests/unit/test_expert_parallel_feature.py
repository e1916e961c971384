from types import SimpleNamespace

from transformers import LlamaConfig, Qwen3MoeConfig

from llmtune.features.expert_parallel import ExpertParallel

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1)


def recipe(degree: int):
    return SimpleNamespace(parallel=SimpleNamespace(expert_parallel=degree),
                           model=SimpleNamespace(trust_remote_code=False))


def moe(experts: int) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16, **SMALL)


def test_is_on_only_above_one():
    assert not ExpertParallel.enabled(recipe(1)) and ExpertParallel.enabled(recipe(2))


def test_accepts_experts_the_degree_divides():
    assert ExpertParallel.check(recipe(2), moe(4), 2) == []


def test_refuses_an_expert_count_the_degree_does_not_divide():
    [problem] = ExpertParallel.check(recipe(4), moe(6), 4)
    assert problem.startswith("parallel.expert_parallel: 4 does not divide the 6 experts")


def test_refuses_a_model_without_experts():
    [problem] = ExpertParallel.check(recipe(2), LlamaConfig(head_dim=16, **SMALL), 2)
    assert "needs a mixture-of-experts model" in problem and "set it to 1" in problem

