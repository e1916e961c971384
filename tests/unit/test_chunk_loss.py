"""The chunked loss (and the plain path's options) against the loss written out on full fp64 logits."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from llmtune.model.loss import IGNORE_INDEX, LossOptions, cross_entropy_sum

H, V = 8, 37
# backward runs from loss * GRAD_SCALE, so a gradient not scaled by grad_output fails every test
GRAD_SCALE = 0.75


def make_inputs(labels: torch.Tensor, bias: bool = False, dtype=torch.float32, seed: int = 0):
    """Leaf hidden [*labels.shape, H], weight [V, H] and optional bias [V], all requiring grad."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*labels.shape, H, generator=gen).to(dtype).requires_grad_()
    weight = torch.randn(V, H, generator=gen).to(dtype).requires_grad_()
    bias = torch.randn(V, generator=gen).to(dtype).requires_grad_() if bias else None
    return hidden, weight, bias


def random_labels(n: int, ignored: slice | None = None, seed: int = 0) -> torch.Tensor:
    labels = torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed))
    if ignored is not None:
        labels[ignored] = IGNORE_INDEX
    return labels


def loss_and_grads(loss_fn, tensors):
    """loss_fn(*tensors) and the gradients of GRAD_SCALE * loss w.r.t. each tensor (None where not given)."""
    loss = loss_fn(*tensors)
    (loss * GRAD_SCALE).backward()
    return loss.detach(), [None if t is None else t.grad for t in tensors]


def fp64_copies(tensors):
    return [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in tensors]


def written_out_loss(hidden, weight, bias, labels, softcap=None, z_loss=0.0, label_smoothing=0.0):
    """Per token: (1 - eps) * nll + eps * mean(-log p) + z_loss * lse**2, summed over the labelled tokens."""
    logits = F.linear(hidden, weight, bias).reshape(-1, V)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    keep = labels.reshape(-1) != IGNORE_INDEX
    logits, labels = logits[keep], labels.reshape(-1)[keep]
    log_p = logits.log_softmax(-1)
    nll = -log_p.gather(1, labels[:, None]).squeeze(1)
    per_token = (1 - label_smoothing) * nll - label_smoothing * log_p.mean(-1) + z_loss * logits.logsumexp(-1) ** 2
    return per_token.sum()


def assert_rel_close(actual, expected, tol):
    """|actual - expected| <= tol * |expected| in the 2-norm (elementwise, near-zero entries would dominate)."""
    err = (actual.double() - expected.double()).norm() / expected.double().norm()
    assert err <= tol, f"relative error {err:.3g} > {tol}"


def check_against(reference, labels, options, bias=False, dtype=torch.float32, tol=1e-5):
    """cross_entropy_sum(options) on `dtype` inputs vs reference on their fp64 copies: loss and every gradient."""
    tensors = make_inputs(labels, bias=bias, dtype=dtype)
    ref_loss, ref_grads = loss_and_grads(lambda h, w, b: reference(h, w, b, labels), fp64_copies(tensors))
    loss, grads = loss_and_grads(lambda h, w, b: cross_entropy_sum(h, w, b, labels, options), tensors)
    assert loss.dtype == torch.float32
    assert_rel_close(loss, ref_loss, tol)
    for grad, ref_grad, tensor in zip(grads, ref_grads, tensors):
        if tensor is not None:
            assert grad.dtype == tensor.dtype
            assert_rel_close(grad, ref_grad, tol)


def f_cross_entropy(hidden, weight, bias, labels, label_smoothing=0.0):
    logits = F.linear(hidden, weight, bias)
    return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum",
                           label_smoothing=label_smoothing)


@pytest.mark.parametrize("labels, chunk_size, bias", [
    pytest.param(random_labels(20, slice(3, 20, 3)), 4, False, id="ignored-tokens"),
    pytest.param(random_labels(20, slice(4, 12)), 4, False, id="all-ignored-chunk"),
    pytest.param(random_labels(19), 4, False, id="short-last-chunk"),
    pytest.param(random_labels(5), 64, False, id="tokens-fewer-than-chunk"),
    pytest.param(random_labels(19, slice(0, 2)), 4, True, id="bias"),
    pytest.param(random_labels(24, slice(10, 13)).reshape(2, 12), 5, True, id="batch-dims"),
])
def test_chunked_matches_f_cross_entropy(labels, chunk_size, bias):
    check_against(f_cross_entropy, labels, LossOptions(chunk_size=chunk_size), bias=bias)


@pytest.mark.parametrize("chunk_size", [0, 4])
def test_label_smoothing_matches_f_cross_entropy(chunk_size):
    def reference(h, w, b, labels):
        return f_cross_entropy(h, w, b, labels, label_smoothing=0.1)
    check_against(reference, random_labels(19, slice(5, 9)), LossOptions(chunk_size, label_smoothing=0.1), bias=True)


@pytest.mark.parametrize("chunk_size", [0, 4], ids=["plain", "chunked"])
@pytest.mark.parametrize("softcap, z_loss, label_smoothing", [
    (3.0, 0.0, 0.0), (None, 1e-2, 0.0), (None, 0.0, 0.2), (2.0, 1e-2, 0.2)
], ids=["softcap", "z-loss", "label-smoothing", "all"])
def test_options_match_written_out_loss(chunk_size, softcap, z_loss, label_smoothing):
    def reference(h, w, b, labels):
        return written_out_loss(h, w, b, labels, softcap, z_loss, label_smoothing)
    options = LossOptions(chunk_size, logit_softcap=softcap, z_loss=z_loss, label_smoothing=label_smoothing)
    check_against(reference, random_labels(19, slice(2, 6)), options, bias=True)


@pytest.mark.parametrize("chunk_size", [0, 4], ids=["plain", "chunked"])
def test_all_tokens_ignored_gives_zero_loss_and_zero_grads(chunk_size):
    labels = torch.full((10,), IGNORE_INDEX)
    tensors = make_inputs(labels, bias=True)
    options = LossOptions(chunk_size, logit_softcap=2.0, z_loss=1e-2, label_smoothing=0.1)
    loss, grads = loss_and_grads(lambda h, w, b: cross_entropy_sum(h, w, b, labels, options), tensors)
    assert loss.item() == 0.0
    for grad, tensor in zip(grads, tensors):
        assert grad.shape == tensor.shape and not grad.any()


def test_bf16_inputs_give_fp32_loss_and_bf16_grads():
    check_against(f_cross_entropy, random_labels(19, slice(2, 6)), LossOptions(chunk_size=4), bias=True,
                  dtype=torch.bfloat16, tol=2e-2)


def test_bf16_weight_grad_is_accumulated_in_fp32():
    # 300 identical tokens in chunks of one: each chunk adds the same term to the weight and bias
    # gradients. Summed in bf16 (8 significant bits) the sum stalls near 256 terms (~15% off).
    labels = torch.full((300,), 3)
    hidden, weight, bias = make_inputs(labels[:1], bias=True, dtype=torch.bfloat16)
    hidden = hidden.detach().repeat(300, 1).requires_grad_()
    _, ref_grads = loss_and_grads(lambda h, w, b: f_cross_entropy(h, w, b, labels),
                                  fp64_copies((hidden, weight, bias)))
    _, grads = loss_and_grads(lambda h, w, b: cross_entropy_sum(h, w, b, labels, LossOptions(chunk_size=1)),
                                 (hidden, weight, bias))
    assert_rel_close(grads[1], ref_grads[1], 1e-2)
    assert_rel_close(grads[2], ref_grads[2], 1e-2)


@pytest.mark.parametrize("chunk_size", [0, 4], ids=["plain", "chunked"])
def test_tied_weight_gets_embedding_and_head_gradients(chunk_size):
    ids = torch.randint(0, V, (13,), generator=torch.Generator().manual_seed(1))
    labels = random_labels(13, slice(0, 3))

    def tied_model(weight, proj):
        hidden = torch.tanh(F.embedding(ids, weight) @ proj)
        return cross_entropy_sum(hidden, weight, None, labels, LossOptions(chunk_size))

    def reference(weight, proj):
        return f_cross_entropy(torch.tanh(F.embedding(ids, weight) @ proj), weight, None, labels)

    gen = torch.Generator().manual_seed(2)
    tensors = (torch.randn(V, H, generator=gen).requires_grad_(), torch.randn(H, H, generator=gen).requires_grad_())
    ref_loss, ref_grads = loss_and_grads(reference, fp64_copies(tensors))
    loss, grads = loss_and_grads(tied_model, tensors)
    assert_rel_close(loss, ref_loss, 1e-5)
    for grad, ref_grad in zip(grads, ref_grads):
        assert_rel_close(grad, ref_grad, 1e-5)


def test_frozen_head_gives_only_the_hidden_gradient():
    labels = random_labels(19, slice(2, 6))
    hidden, weight, _ = make_inputs(labels)
    weight.requires_grad_(False)
    ref_hidden, ref_weight = fp64_copies((hidden, weight))
    (f_cross_entropy(ref_hidden, ref_weight, None, labels) * GRAD_SCALE).backward()
    (cross_entropy_sum(hidden, weight, None, labels, LossOptions(chunk_size=4)) * GRAD_SCALE).backward()
    assert weight.grad is None
    assert_rel_close(hidden.grad, ref_hidden.grad, 1e-5)


def test_evaluation_computes_the_loss_and_no_gradients():
    labels = random_labels(19, slice(2, 6))
    tensors = make_inputs(labels, bias=True)
    options = LossOptions(chunk_size=4, logit_softcap=2.0)
    expected = cross_entropy_sum(*tensors, labels, options).detach()
    with torch.no_grad(), FlopCounterMode(display=False) as flops:
        loss = cross_entropy_sum(*tensors, labels, options)
    assert loss.grad_fn is None
    assert torch.equal(loss, expected)
    # only the logits' matmul of the 15 labelled tokens: no gradient matmul ran
    assert flops.get_total_flops() == 2 * 15 * H * V


def test_second_backward_is_refused_with_a_clear_error():
    labels = random_labels(8)
    hidden, weight, _ = make_inputs(labels)
    loss = cross_entropy_sum(hidden, weight, None, labels, LossOptions(chunk_size=4))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward only"):
        loss.backward()
