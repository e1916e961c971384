"""The real models the recipes in recipes/ name: their shapes, written here as numbers (facts read from each
model's published config.json), and the parameter counts their model cards print. The tests build every model
on the meta device from these numbers, so the suite reads no file outside the project and downloads nothing.
"""

from typing import NamedTuple


class RealModel(NamedTuple):
    shape: dict  # the config.json keys that decide the parameters and the layout, with their published values
    # Parameter counts in billions as published (model card or the Hub's count), None where none is published.
    params_b: float
    non_embedding_b: float | None = None
    activated_b: float | None = None


QWEN3_8B = RealModel(
    shape={"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
           "tie_word_embeddings": False, "rope_theta": 1000000.0, "max_position_embeddings": 40960},
    # Qwen3-8B's model card: 8.2B parameters, 6.95B without the embeddings.
    params_b=8.2, non_embedding_b=6.95,
)

LLAMA_3_1_8B = RealModel(
    shape={"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
           "tie_word_embeddings": False, "rope_theta": 500000.0, "max_position_embeddings": 131072,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}},
    # The Hub's exact count of the safetensors weights (shown as 8.03B); base and Instruct share the shapes.
    params_b=8.030261248,
)

LLAMA_3_1_70B = RealModel(
    shape={**LLAMA_3_1_8B.shape, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
           "num_attention_heads": 64},
    # The Hub's exact count of the safetensors weights (shown as 70.6B); base and Instruct share the shapes.
    params_b=70.553706496,
)

QWEN3_30B_A3B_2507 = RealModel(
    shape={"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
           # The config.json at hand (shared/real) was cut to 4 layers by the project it came from; the published
           # model has 48 (its model card, and that file's own max_window_layers: 48).
           "num_hidden_layers": 48,
           "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
           "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
           "vocab_size": 151936, "tie_word_embeddings": False, "rope_theta": 10000000.0,
           "max_position_embeddings": 262144},
    # Qwen3-30B-A3B-Instruct-2507's model card: 30.5B in total, 3.3B activated, 29.9B without the embeddings.
    params_b=30.5, non_embedding_b=29.9, activated_b=3.3,
)

REAL_MODELS = {
    "Qwen/Qwen3-8B": QWEN3_8B,
    "meta-llama/Llama-3.1-8B": LLAMA_3_1_8B,
    "meta-llama/Llama-3.1-8B-Instruct": LLAMA_3_1_8B,
    "meta-llama/Llama-3.1-70B-Instruct": LLAMA_3_1_70B,
    "Qwen/Qwen3-30B-A3B-Instruct-2507": QWEN3_30B_A3B_2507,
}
