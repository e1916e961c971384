"""The attention core of context parallelism, in one process: over a full sequence of packed documents it
gives, with sdpa and eager, the outputs and gradients of attention under an explicit causal,
same-document (and sliding-window) mask, whether it attends in one call or document span by
document span; and the spans hold whole documents, never more than the window unless one document is
longer."""

import types

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention

from llmtune.model.attention import attend, backend_function, document_windows

HEADS, KV_HEADS, DIM = 4, 2, 8
# Two rows of packed documents; the second ends with a pad "document" (positions restart, as collate makes it).
DOCUMENTS = [[5, 23, 2, 30, 4], [40, 1, 10, 9, 4]]


def positions() -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCUMENTS])


def reference(query, key, value, positions, sliding_window):
    """softmax(q k^T * scale + mask) v with the mask written out: causal, same document, sliding window."""
    starts = torch.diff(positions, dim=1, prepend=positions[:, :1] - 1) != 1
    documents = starts.cumsum(dim=1)
    index = torch.arange(positions.shape[1])
    allowed = (index[:, None] >= index[None, :]) & (documents[:, :, None] == documents[:, None, :])
    if sliding_window:
        allowed &= (index[:, None] - index[None, :]) < sliding_window
    groups = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    scores = (query @ key.transpose(-1, -2)) * DIM ** -0.5
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return (scores.softmax(dim=-1) @ value).transpose(1, 2)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("window", [16, 32, 64])
@pytest.mark.parametrize("sliding_window", [None, 6])
def test_attention_equals_the_explicitly_masked_reference(backend, window, sliding_window):
    torch.manual_seed(0)
    pos = positions()
    length = pos.shape[1]
    query = torch.randn(2, HEADS, length, DIM, requires_grad=True)
    key, value = (torch.randn(2, KV_HEADS, length, DIM, requires_grad=True) for _ in range(2))
    config = LlamaConfig(hidden_size=HEADS * DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS)
    model_module = LlamaAttention(config, layer_idx=0)
    local = types.SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, is_causal=True, training=True,
                                  config=config)
    out = attend(backend_function(model_module, backend), local, query, key, value, pos, sliding_window,
                 backend == "eager", window=window, dropout=0.0, scaling=DIM ** -0.5)
    expected = reference(query, key, value, pos, sliding_window)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    upstream = torch.randn_like(expected)
    grads = torch.autograd.grad(out, (query, key, value), upstream)
    expected_grads = torch.autograd.grad(expected, (query, key, value), upstream)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-5)


def test_spans_hold_whole_documents_up_to_the_window():
    pos = positions()
    assert document_windows(pos[0], 16) == [(0, 5), (5, 28), (28, 30), (30, 60), (60, 64)]
    assert document_windows(pos[0], 32) == [(0, 30), (30, 60), (60, 64)]
    assert document_windows(pos[1], 24) == [(0, 40), (40, 64)]
    assert document_windows(pos[1], 100) == [(0, 64)]


def test_auto_picks_flash_attention_only_where_it_can_train(monkeypatch):
    import transformers.utils as hf_utils
    from transformers import Qwen2Config

    from llmtune.model.attention import resolve_backend

    config = LlamaConfig()
    assert resolve_backend("auto", config, cuda=False, bf16=True) is None  # transformers' pick: sdpa
    monkeypatch.setattr(hf_utils, "is_flash_attn_2_available", lambda: True)
    monkeypatch.setattr(hf_utils, "is_flash_attn_3_available", lambda: False)
    assert resolve_backend("auto", config, cuda=True, bf16=True) == "flash_attention_2"
    assert resolve_backend("auto", Qwen2Config(), cuda=True, bf16=True) == "flash_attention_2"
    assert resolve_backend("auto", config, cuda=True, bf16=False) is None  # flash attention has no fp32
    assert resolve_backend("eager", config, cuda=True, bf16=True) == "eager"
    monkeypatch.setattr(hf_utils, "is_flash_attn_2_available", lambda: False)
    # Without flash-attn, torch's own varlen kernels; without those too, transformers' pick.
    assert resolve_backend("auto", config, cuda=True, bf16=True) == "varlen"
    monkeypatch.setattr("llmtune.model.varlen.available", lambda: False)
    assert resolve_backend("auto", config, cuda=True, bf16=True) is None


def test_backend_problems_name_what_is_missing(monkeypatch):
    import transformers.utils as hf_utils

    from llmtune.model.attention import backend_problems

    assert backend_problems("sdpa", cuda=False, bf16=False) == []
    assert backend_problems("flex_attention", cuda=True, bf16=True) == []
    monkeypatch.setattr(hf_utils, "is_flash_attn_2_available", lambda: False)
    monkeypatch.setattr(hf_utils, "is_kernels_available", lambda: False)
    assert backend_problems("flash_attention_2", cuda=True, bf16=False) == [
        "model.attn_implementation: flash_attention_2 computes in bf16 or fp16 only; set train.bf16 (or fp16): true, or use sdpa",
        "model.attn_implementation: flash_attention_2 needs a package this environment lacks: pip install flash-attn, "
        "or kernels (transformers then loads the kernel from the Hub)"]
    assert backend_problems("kernels-community/flash-attn3", cuda=True, bf16=True) == [
        "model.attn_implementation: kernels-community/flash-attn3 needs a package this environment lacks: "
        "pip install kernels"]
    monkeypatch.setattr(hf_utils, "is_kernels_available", lambda: True)
    assert backend_problems("flash_attention_2", cuda=True, bf16=True) == []
