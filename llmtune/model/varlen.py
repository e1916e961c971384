"""model.attn_implementation: varlen, torch's own flash attention variable-length kernels
(`torch.nn.attention.varlen.varlen_attn`: no extra package, its own backward, registered for torch.compile), on a
CUDA device. Packed rows need no mask: the documents' boundaries come as cu_seq_lens over the micro-batch's rows
laid end to end (attention.varlen_kwargs, added by the packed documents' feature), as flash-attn's varlen kernels take
them. `auto` picks it on a CUDA device without flash-attn (attention.resolve_backend).

Its signature changed between torch releases: 2.12 and later take grouped key/value heads (enable_gqa; before,
they are repeated to the query's heads) and a window_size (causal, and a sliding window); earlier ones take
is_causal, which serves a model with no sliding window, the others refused when they run (and, without a scale
argument, one whose attention scale is not the default).
"""

import inspect

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv

VARLEN = "varlen"


def available() -> bool:
    """Whether this torch has the kernels' Python entry."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def varlen_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                             scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
                             cu_seq_lens_q: torch.Tensor | None = None, cu_seq_lens_k: torch.Tensor | None = None,
                             max_length_q: int | None = None, max_length_k: int | None = None, **kwargs):
    """transformers' attention function signature: query [b, h, S, d], key/value [b, kv, S, d] -> ([b, S, h, d],
    None). Causal within each document, and within the sliding window (the last `sliding_window` positions, as
    transformers' masks count them). A call without cu_seq_lens (a probe of the bare model, one sequence a row)
    attends each row as one document."""
    from torch.nn.attention.varlen import varlen_attn

    if dropout:
        raise ValueError("varlen attention has no dropout; set the model config's attention_dropout to 0")
    rows, heads, length, dim = query.shape
    if cu_seq_lens_q is None:
        cu_seq_lens_q = cu_seq_lens_k = torch.arange(0, (rows + 1) * length, length, dtype=torch.int32,
                                                     device=query.device)
        max_length_q = max_length_k = length
    takes = inspect.signature(varlen_attn).parameters
    if "enable_gqa" not in takes:
        groups = heads // key.shape[1]
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    flat = [t.transpose(1, 2).reshape(rows * length, t.shape[1], dim) for t in (query, key, value)]
    out = varlen_attn(*flat, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k,
                      **_options(takes, scaling, sliding_window, dim))
    return out.reshape(rows, length, heads, dim), None


def _options(takes, scaling: float | None, sliding_window: int | None, dim: int) -> dict:
    """varlen_attn's keyword arguments for causal attention within the sliding window, in its torch's signature
    (`takes`: its parameters)."""
    options = {"enable_gqa": True} if "enable_gqa" in takes else {}
    if "window_size" in takes:
        options["window_size"] = (sliding_window - 1 if sliding_window else -1, 0)
    elif sliding_window:
        raise ValueError(f"varlen attention: torch {torch.__version__}'s varlen_attn takes no sliding window, which "
                         "this model has; use sdpa, or torch 2.12 or later")
    else:
        options["is_causal"] = True
    if "scale" in takes:
        options["scale"] = scaling
    elif scaling is not None and scaling != dim ** -0.5:
        raise ValueError(f"varlen attention: torch {torch.__version__}'s varlen_attn takes no scale, and this model's "
                         "is not 1/sqrt(head_dim); use sdpa, or torch 2.12 or later")
    return options


AttentionInterface.register(VARLEN, varlen_attention_forward)
