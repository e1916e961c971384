"""The model families llmtune is tested on: one tiny config of each real transformers class, shapes kept
small and the features that make the family different kept on. tests/dist/test_model_matrix.py trains every
entry; docs/models.md is rendered from this list (python docs/models_table.py)."""

from dataclasses import dataclass, field

# Shared small shapes: 4 query heads and 2 key/value heads, so that cp=2 can spread both.
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
# Shorter than the tests' sequences, so that the sliding window masks something.
WINDOW = 16


@dataclass(frozen=True)
class Family:
    name: str
    model_type: str  # transformers' config model_type; the class is AutoModelForCausalLM's for it
    features: str  # what the tiny config keeps of the real family
    config: dict = field(default_factory=dict)  # on top of SMALL; None removes a SMALL key
    notes: str = ""
    mixture_of_experts: bool = False

    def hf_config(self, vocab_size: int, bos_token_id: int = 1, eos_token_id: int = 2, pad_token_id: int = 0):
        """The transformers config of the tiny model, its special tokens inside the vocabulary."""
        from transformers import AutoConfig

        merged = {**SMALL, **self.config}
        return AutoConfig.for_model(self.model_type, vocab_size=vocab_size, bos_token_id=bos_token_id,
                                    eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                                    **{key: value for key, value in merged.items() if value is not None})


FAMILIES = (
    Family("Llama-3.x", "llama", "GQA, llama3 rope scaling, untied embeddings",
           dict(tie_word_embeddings=False, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                             high_freq_factor=4.0,
                                                             original_max_position_embeddings=32),
                rope_theta=500000.0)),
    Family("Qwen2.5", "qwen2", "GQA, q/k/v biases, tied embeddings", dict(tie_word_embeddings=True)),
    Family("Qwen3", "qwen3", "GQA, q/k norm, head_dim apart from hidden/heads, tied embeddings",
           dict(head_dim=32, tie_word_embeddings=True)),
    Family("Mistral", "mistral", "GQA, sliding window on every layer, untied embeddings",
           dict(sliding_window=WINDOW, tie_word_embeddings=False)),
    Family("Gemma-2", "gemma2", "alternating sliding/full layers, attention and final logit soft-capping, "
                                "scaled embeddings, query_pre_attn_scalar, tied embeddings",
           dict(head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"]),
           "no sdpa in transformers (soft-capped attention): `auto` picks eager; `sdpa` is refused"),
    Family("Gemma-3 (text)", "gemma3_text", "alternating sliding/full layers with their own rope, q/k norm, "
                                            "scaled embeddings, tied embeddings",
           dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                layer_types=["sliding_attention", "full_attention"])),
    Family("Phi-3 / Phi-4", "phi3", "fused qkv_proj and gate_up_proj, partial rotary (Phi-4-mini), untied",
           dict(partial_rotary_factor=0.75, tie_word_embeddings=False)),
    Family("OLMo-2", "olmo2", "q/k norm over all heads, norms after attention and MLP, untied",
           dict(tie_word_embeddings=False)),
    Family("SmolLM3", "smollm3", "layers without rope (NoPE), GQA, tied embeddings",
           dict(no_rope_layers=[1, 0], tie_word_embeddings=True)),
    Family("GPT-2", "gpt2", "GPT-2 config names, learned positions, LayerNorm, Conv1D, biases, tied embeddings",
           dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, hidden_size=None, intermediate_size=None,
                num_hidden_layers=None, num_attention_heads=None, num_key_value_heads=None,
                max_position_embeddings=None),
           "ships with dropout 0.1, kept: the resume is bitwise with it; cp=2 is compared to cp=1 without it"),
    Family("GPT-NeoX", "gpt_neox", "fused qkv, partial rotary, parallel residual, LayerNorm with biases, untied",
           dict(num_key_value_heads=None, tie_word_embeddings=False),
           "its checkpoints name the lm_head embed_out: read and exported under that name, by transformers' "
           "renaming rules"),
)

# Mixture-of-experts families: 4 experts, 2 per token; the router loss coefficient made large enough to matter.
MOE = dict(num_experts_per_tok=2, router_aux_loss_coef=0.1, tie_word_embeddings=False)

FAMILIES += (
    Family("Qwen3-MoE", "qwen3_moe", "routed experts (stored one by one, fused in memory), router load-balancing "
                                     "loss, q/k norm, untied",
           dict(num_experts=4, moe_intermediate_size=32, head_dim=16, **MOE), mixture_of_experts=True),
    Family("Mixtral", "mixtral", "routed experts stored as block_sparse_moe w1/w2/w3, router load-balancing loss, "
                                 "sliding window, untied",
           dict(num_local_experts=4, intermediate_size=32, sliding_window=WINDOW, **MOE), mixture_of_experts=True),
    Family("gpt-oss", "gpt_oss", "experts with biases stored fused, attention sinks, alternating sliding/full "
                                 "layers, yarn rope, router load-balancing loss, untied",
           dict(num_local_experts=4, intermediate_size=32, head_dim=16, sliding_window=WINDOW,
                layer_types=["sliding_attention", "full_attention"],
                rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                                     beta_slow=1.0, truncate=False, original_max_position_embeddings=64), **MOE),
           "no sdpa in transformers (sinks): `auto` picks eager; context parallelism refuses attention sinks",
           mixture_of_experts=True),
    Family("DeepSeek-V3", "deepseek_v3", "MLA attention (q and kv low-rank, decoupled yarn rope), shared expert, "
                                         "group-limited routing with the router's bias buffer, first layer dense",
           dict(n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1,
                q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=2,
                topk_group=1, num_key_value_heads=4, num_experts_per_tok=2, tie_word_embeddings=False,
                rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                     original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0)),
           "no router loss in transformers (it balances with the bias buffer): aux_loss and expert_load are not "
           "logged", mixture_of_experts=True),
)


def table(vocab_size: int = 300) -> str:
    """docs/models.md: what each family keeps, the backend `auto` gives it, and whether cp=2 runs it, as llmtune's
    own code decides them (transformers on a meta model, the context-parallel check)."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmtune.features.ulysses import layout_problems

    rows = ["# Supported model families", "",
            "Generated by `python docs/models_table.py` from `tests/model_matrix.py`, the list "
            "`tests/dist/test_model_matrix.py` trains: for each family a tiny config of the real transformers "
            "class, on 2 processes, pt and sft steps, a bitwise resume, an export that from_pretrained loads with "
            "the trained logits (fp32, 1e-5), and cp=2 against cp=1 (1e-5). Mixture-of-experts families load from "
            "the layout save_pretrained writes (the Hub's: experts one tensor each) and export it again; their "
            "pt runs log aux_loss and expert_load where the class has a router loss, which the cp comparison "
            "turns off (it is computed per cp slice).", "",
            "| family | class | tested features | attention (`auto`) | cp=2 | notes |", "|---|---|---|---|---|---|"]
    for family in FAMILIES:
        config = family.hf_config(vocab_size)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        cp = "; ".join(layout_problems(config, 2)) or "yes"
        rows.append(f"| {family.name} | `{type(model).__name__}` | {family.features} | "
                    f"{model.config._attn_implementation} | {cp} | {family.notes} |")
    return "\n".join(rows) + "\n"
