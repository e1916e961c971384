"""token_logps: the chunked path's log-probabilities and gradients against the full-logits path (and an fp64
reference), ignored labels, the link to the loss, and no [tokens, vocab] tensor on the chunked path."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from llmtune.model.loss import IGNORE_INDEX, LossOptions, cross_entropy_sum, token_logps
from tests.unit.test_chunk_loss import H, V, assert_rel_close, make_inputs, random_labels


def upstream(shape) -> torch.Tensor:
    """A grad_output that differs per token (some negative, one zero), as DPO's weights of the sequences' sums do."""
    gen = torch.Generator().manual_seed(7)
    grad = torch.randn(shape, generator=gen)
    grad.view(-1)[0] = 0.0
    return grad


def logps_and_grads(tensors, labels, options):
    """token_logps of the tensors and the gradients of sum(logps * upstream) w.r.t. each (None where not given)."""
    logps = token_logps(*tensors, labels, options)
    (logps * upstream(labels.shape).to(logps.dtype)).sum().backward()
    return logps.detach(), [None if t is None else t.grad for t in tensors]


def copies(tensors, dtype):
    return [None if t is None else t.detach().to(dtype).requires_grad_() for t in tensors]


def written_out_logps(hidden, weight, bias, labels, softcap=None):
    """log_softmax of the (capped) logits at each label, 0 where ignored: the definition, in the inputs' dtype."""
    logits = F.linear(hidden, weight, bias)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    labelled = labels != IGNORE_INDEX
    picked = logits.log_softmax(-1).gather(-1, labels.where(labelled, 0)[..., None]).squeeze(-1)
    return picked * labelled


def written_out_and_grads(tensors, labels, softcap=None):
    """written_out_logps on fp64 copies of the tensors and the gradients of sum(logps * upstream)."""
    tensors = copies(tensors, torch.float64)
    logps = written_out_logps(*tensors, labels, softcap)
    (logps * upstream(labels.shape).double()).sum().backward()
    return logps.detach(), [None if t is None else t.grad for t in tensors]


def check_against(reference, tensors, labels, options, tol):
    """token_logps(options) vs (values, grads) of the reference: values and every gradient, each in its input's
    dtype."""
    ref, ref_grads = reference
    logps, grads = logps_and_grads(tensors, labels, options)
    assert logps.dtype == torch.float32 and logps.shape == labels.shape
    assert_rel_close(logps, ref, tol)
    for grad, ref_grad, tensor in zip(grads, ref_grads, tensors):
        if tensor is not None:
            assert grad.dtype == tensor.dtype
            assert_rel_close(grad, ref_grad, tol)


@pytest.mark.parametrize("labels, chunk_size", [
    pytest.param(random_labels(23, slice(3, 20, 3)), 4, id="ignored-tokens-17-labelled-by-4"),
    pytest.param(random_labels(23, slice(4, 12)), 5, id="all-ignored-chunk-by-5"),
    pytest.param(random_labels(19), 1, id="chunks-of-one"),
    pytest.param(random_labels(19), 7, id="19-by-7"),
    pytest.param(random_labels(5), 64, id="tokens-fewer-than-chunk"),
    pytest.param(random_labels(24, slice(10, 13)).reshape(2, 12), 5, id="batch-dims"),
])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_chunked_matches_full_logits(labels, chunk_size, bias):
    tensors = make_inputs(labels, bias)
    full = logps_and_grads(copies(tensors, torch.float32), labels, LossOptions(0))
    check_against(full, tensors, labels, LossOptions(chunk_size), tol=1e-5)


@pytest.mark.parametrize("chunk_size", [3, 8])
def test_softcap_matches_full_logits(chunk_size):
    labels = random_labels(19, slice(2, 6))
    tensors = make_inputs(labels, bias=True)
    full = logps_and_grads(copies(tensors, torch.float32), labels, LossOptions(0, logit_softcap=2.0))
    check_against(full, tensors, labels, LossOptions(chunk_size, logit_softcap=2.0), tol=1e-5)


@pytest.mark.parametrize("chunk_size", [0, 4], ids=["full", "chunked"])
@pytest.mark.parametrize("softcap", [None, 2.0], ids=["uncapped", "softcap"])
def test_both_paths_match_the_written_out_log_softmax(chunk_size, softcap):
    labels = random_labels(24, slice(10, 13)).reshape(2, 12)
    tensors = make_inputs(labels, bias=True)
    reference = written_out_and_grads(tensors, labels, softcap)
    check_against(reference, tensors, labels, LossOptions(chunk_size, logit_softcap=softcap), tol=1e-5)


def test_bf16_inputs_give_fp32_logps_and_bf16_grads():
    labels = random_labels(19, slice(2, 6))
    tensors = make_inputs(labels, bias=True, dtype=torch.bfloat16)
    reference = written_out_and_grads(tensors, labels)
    check_against(reference, tensors, labels, LossOptions(4), tol=2e-2)


def test_bf16_weight_grad_is_accumulated_in_fp32():
    # 300 identical tokens in chunks of one: each chunk adds the same term to the weight and bias gradients. Summed
    # in bf16 (8 significant bits) the sum would stall near 256 terms (~15% off).
    labels = torch.full((300,), 3)
    hidden, weight, bias = make_inputs(labels[:1], bias=True, dtype=torch.bfloat16)
    hidden = hidden.detach().repeat(300, 1).requires_grad_()
    tensors = (hidden, weight, bias)
    _, ref_grads = written_out_and_grads(tensors, labels)
    _, grads = logps_and_grads(tensors, labels, LossOptions(chunk_size=1))
    assert_rel_close(grads[1], ref_grads[1], 1e-2)
    assert_rel_close(grads[2], ref_grads[2], 1e-2)


@pytest.mark.parametrize("chunk_size", [0, 4], ids=["full", "chunked"])
def test_ignored_labels_give_zero_and_no_gradient(chunk_size):
    labels = random_labels(19, slice(2, 9))
    tensors = make_inputs(labels, bias=True)
    logps, grads = logps_and_grads(tensors, labels, LossOptions(chunk_size, logit_softcap=2.0))
    ignored = labels == IGNORE_INDEX
    assert torch.equal(logps[ignored], torch.zeros(7))
    assert (logps[~ignored] < 0).all()
    assert not grads[0][ignored].any() and grads[0][~ignored].any()


@pytest.mark.parametrize("chunk_size", [0, 4], ids=["full", "chunked"])
def test_summed_logps_are_minus_the_summed_loss(chunk_size):
    labels = random_labels(24, slice(10, 13)).reshape(2, 12)
    options = LossOptions(chunk_size, logit_softcap=3.0)
    tensors = make_inputs(labels, bias=True)
    token_logps(*tensors, labels, options).sum().backward()
    grads = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    loss = cross_entropy_sum(*tensors, labels, options)
    loss.backward()
    assert_rel_close(token_logps(*tensors, labels, options).sum().detach(), -loss.detach(), 1e-5)
    for grad, tensor in zip(grads, tensors):
        assert_rel_close(grad, -tensor.grad, 1e-5)


@pytest.mark.parametrize("chunk_size", [0, 4], ids=["full", "chunked"])
def test_z_loss_and_label_smoothing_leave_the_logps_unchanged(chunk_size):
    labels = random_labels(19, slice(2, 6))
    tensors = make_inputs(labels, bias=True)
    plain = token_logps(*tensors, labels, LossOptions(chunk_size))
    with_loss_terms = token_logps(*tensors, labels, LossOptions(chunk_size, z_loss=0.1, label_smoothing=0.2))
    assert torch.equal(plain, with_loss_terms)


def test_without_grad_mode_only_the_logps_are_computed():
    labels = random_labels(19, slice(2, 6))
    tensors = make_inputs(labels, bias=True)
    options = LossOptions(4, logit_softcap=2.0)
    expected = token_logps(*tensors, labels, options).detach()
    with torch.no_grad(), FlopCounterMode(display=False) as flops:
        logps = token_logps(*tensors, labels, options)
    assert logps.grad_fn is None
    assert torch.equal(logps, expected)
    assert flops.get_total_flops() == 2 * 15 * H * V  # the logits' matmul of the 15 labelled tokens


def test_forward_computes_no_gradient():
    """In grad mode too, forward runs the logits' matmul alone: the gradients wait for backward's grad_output."""
    labels = random_labels(19, slice(2, 6))
    tensors = make_inputs(labels, bias=True)
    with FlopCounterMode(display=False) as flops:
        logps = token_logps(*tensors, labels, LossOptions(4))
    assert logps.requires_grad
    assert flops.get_total_flops() == 2 * 15 * H * V


def test_backward_runs_more_than_once():
    """The logits are recomputed in backward, so the graph can be walked again (retain_graph), unlike the loss's."""
    labels = random_labels(19, slice(2, 6))
    hidden, weight, _ = make_inputs(labels, bias=False)
    logps = token_logps(hidden, weight, None, labels, LossOptions(4))
    logps.sum().backward(retain_graph=True)
    first = weight.grad.clone()
    logps.sum().backward()
    assert_rel_close(weight.grad, 2 * first, 1e-6)


class LargestStorage(TorchDispatchMode):
    """Every op's outputs, forward and backward: the largest storage (in elements) any of them lives in."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                self.largest = max(self.largest, storage.nbytes() // tensor.element_size())
        return out


@pytest.mark.parametrize("chunk_size", [0, 16], ids=["full", "chunked"])
def test_chunked_path_never_holds_a_tokens_by_vocab_tensor(chunk_size):
    tokens, vocab, hidden_size = 512, 64, 8  # tokens x vocab: 32,768 elements; a block 1,024
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, generator=gen, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    with LargestStorage() as probe:
        logps = token_logps(hidden, weight, None, labels, LossOptions(chunk_size, logit_softcap=5.0))
        (logps * torch.linspace(-1, 1, tokens)).sum().backward()
    if chunk_size:  # nothing larger than one block or the hidden states' gradient
        assert probe.largest <= max(chunk_size * vocab, tokens * hidden_size)
    else:  # the probe sees the full path's logits: it would see them on the chunked path too
        assert probe.largest >= tokens * vocab
