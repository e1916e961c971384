"""model.attn_implementation: varlen (model/varlen.py), torch's own flash attention varlen kernels. There are none
on a CPU: a stand-in of varlen_attn with its signature (torch 2.12's, and the earlier is_causal-only one) checks what
the backend hands it for packed rows of several documents in two rows (cu_seq_lens over the rows end to end, the
longest document, grouped key/value heads, the sliding window) and attends as the kernel would, so that the rows
give every document's logits and gradients alone (sdpa, fp32). Refused off CUDA and in fp32 in one line."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

from llmtune.features.documents import PackedDocuments
from llmtune.model import attention, varlen
from tests.unit.test_packed_attention import DOCUMENTS, LENGTH, documents_alone, logits_and_grads, positions



def reference_mask(length: int, left: int) -> torch.Tensor:
    """Causal within `left` positions back (-1: all), as flash attention's window_size (left, 0)."""
    index = torch.arange(length)
    distance = index[:, None] - index[None, :]
    return (distance >= 0) & ((distance <= left) if left >= 0 else True)


def stand_in(calls: list):
    """varlen_attn of torch 2.12 on a CPU: each cu_seq_q segment attended alone; the call recorded."""

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        calls.append(dict(heads=(query.shape[1], key.shape[1]), cu_seq_q=cu_seq_q, cu_seq_k=cu_seq_k, max_q=max_q,
                          max_k=max_k, window_size=window_size, enable_gqa=enable_gqa, scale=scale))
        bounds = cu_seq_q.tolist()
        pieces = []
        for a, b in zip(bounds, bounds[1:]):
            q, k, v = (t[a:b].transpose(0, 1) for t in (query, key, value))
            pieces.append(F.scaled_dot_product_attention(q, k, v, attn_mask=reference_mask(b - a, window_size[0]),
                                                         scale=scale, enable_gqa=enable_gqa).transpose(0, 1))
        return torch.cat(pieces)

    return varlen_attn


def old_stand_in(calls: list):
    """varlen_attn before torch 2.12: is_causal alone, as many key/value heads as query heads."""
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        calls.append(dict(heads=(query.shape[1], key.shape[1]), is_causal=is_causal))
        return stand_in([])(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=(-1, 0))
    return varlen_attn


def tiny(config_class, **extra):
    torch.manual_seed(0)
    config = config_class(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, **extra)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


@pytest.mark.parametrize("config_class, extra, window", [(LlamaConfig, {}, -1),
                                                         (MistralConfig, {"sliding_window": 8}, 7)])
def test_packed_rows_through_varlen_give_every_document_alone(monkeypatch, config_class, extra, window):
    calls = []
    monkeypatch.setattr("torch.nn.attention.varlen.varlen_attn", stand_in(calls))
    model = tiny(config_class, **extra)
    model.set_attn_implementation(varlen.VARLEN)
    feature = PackedDocuments(None)
    feature.build(model, None)
    ids = torch.randint(0, 97, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    weights = torch.randn(2, LENGTH, 97, generator=torch.Generator().manual_seed(2))
    logits, grads = logits_and_grads(model, feature.transform({"input_ids": ids, "position_ids": positions()}), weights)
    assert len(calls) == 2  # one call a layer for both rows
    bounds = torch.tensor([0, *torch.tensor(sum(DOCUMENTS, [])).cumsum(0).tolist()], dtype=torch.int32)
    for call in calls:
        assert call["cu_seq_q"].dtype == torch.int32 and torch.equal(call["cu_seq_q"], bounds)
        assert torch.equal(call["cu_seq_k"], bounds)
        assert call["max_q"] == call["max_k"] == 40
        # Grouped heads as the model has them, causal within the sliding window (transformers' last 8 positions).
        assert (call["heads"], call["enable_gqa"], call["window_size"]) == ((4, 2), True, (window, 0))
        assert call["scale"] == pytest.approx(8 ** -0.5)
    model.set_attn_implementation("sdpa")
    expected_logits, expected_grads = documents_alone(model, ids, weights)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-5, msg=name)


def test_before_torch_2_12_keys_are_repeated_and_a_sliding_window_refused(monkeypatch):
    calls = []
    monkeypatch.setattr("torch.nn.attention.varlen.varlen_attn", old_stand_in(calls))
    query, key = torch.randn(1, 4, 16, 8), torch.randn(1, 2, 16, 8)
    out, _ = varlen.varlen_attention_forward(None, query, key, key, None)
    assert out.shape == (1, 16, 4, 8) and calls == [dict(heads=(4, 4), is_causal=True)]
    expected = F.scaled_dot_product_attention(query, key, key, is_causal=True, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="takes no sliding window, which this model has"):
        varlen.varlen_attention_forward(None, query, key, key, None, sliding_window=8)
    with pytest.raises(ValueError, match="takes no scale, and this model's is not 1/sqrt"):
        varlen.varlen_attention_forward(None, query, key, key, None, scaling=0.1)


def test_varlen_is_refused_off_cuda_and_in_fp32_in_one_line(monkeypatch):
    """auto's pick of it: tests/unit/test_attention.py."""
    assert attention.backend_problems("varlen", cuda=False, bf16=True) == [
        "model.attn_implementation: varlen needs a CUDA device and this machine has none; use auto (sdpa here) or sdpa"]
    assert attention.backend_problems("varlen", cuda=True, bf16=False) == [
        "model.attn_implementation: varlen computes in bf16 or fp16 only; set train.bf16 (or fp16): true, or use sdpa"]
    monkeypatch.setattr("llmtune.model.varlen.available", lambda: False)
    assert attention.backend_problems("varlen", cuda=True, bf16=True)[0].startswith(
        "model.attn_implementation: varlen needs torch.nn.attention.varlen, which torch")
