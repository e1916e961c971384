"""Packed rows on one rank (features/documents.py): with sdpa and eager (document span by document span) and with a
varlen backend (handed cu_seq_lens), a tiny Llama's logits and gradients equal those of every document run alone;
no mask larger than the window is ever built; with document masks off the rows attend causally as a whole, as
transformers' own path does."""

import types

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig

from llmtune.features import documents, ulysses
from llmtune.features.documents import PackedDocuments
from llmtune.model import attention
from llmtune.model.attention import varlen_kwargs
from llmtune.model.build import compile_layer
from tests.helpers import compile_with_backend

# Two rows of packed documents; the second ends with a pad "document" (positions restart, as collate makes it).
DOCUMENTS = [[5, 23, 2, 30, 4], [40, 1, 10, 9, 4]]
LENGTH = 64
VARLEN = "llmtune_test_varlen"


def positions() -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCUMENTS])


def tiny_llama(backend: str):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return AutoModelForCausalLM.from_config(config, attn_implementation=backend)


def input_ids(rows: int = 2) -> torch.Tensor:
    return torch.randint(0, 97, (rows, LENGTH), generator=torch.Generator().manual_seed(1))


def logits_and_grads(model, inputs, weights):
    model.zero_grad()
    logits = model(**inputs, use_cache=False).logits
    (logits * weights).sum().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def documents_alone(model, ids, weights):
    """The reference: every document of every row run through the model on its own, positions from 0."""
    model.zero_grad()
    rows = []
    for row, lengths in enumerate(DOCUMENTS):
        start, pieces = 0, []
        for n in lengths:
            pieces.append(model(input_ids=ids[row:row + 1, start:start + n], use_cache=False).logits)
            start += n
        rows.append(torch.cat(pieces, dim=1))
    logits = torch.cat(rows)
    (logits * weights).sum().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def varlen_reference_backend(module, query, key, value, attention_mask, *, scaling=None, cu_seq_lens_q=None,
                             cu_seq_lens_k=None, max_length_q=None, max_length_k=None, **kwargs):
    """A CPU stand-in for flash attention's varlen kernel: the rows laid end to end, each cu_seq_lens segment
    attended alone (causal); without boundaries, each row causally as a whole, as flash attention does."""
    assert attention_mask is None
    batch, heads, length, dim = query.shape
    flat = [t.transpose(1, 2).reshape(batch * length, t.shape[1], dim).transpose(0, 1) for t in (query, key, value)]
    if cu_seq_lens_q is None:
        bounds = list(range(0, batch * length + 1, length))
    else:
        assert cu_seq_lens_q.dtype == torch.int32 and torch.equal(cu_seq_lens_q, cu_seq_lens_k)
        bounds = cu_seq_lens_q.tolist()
        assert max_length_q == max_length_k == max(b - a for a, b in zip(bounds, bounds[1:]))
    pieces = [F.scaled_dot_product_attention(*(t[:, a:b] for t in flat), is_causal=True, scale=scaling,
                                             enable_gqa=True) for a, b in zip(bounds, bounds[1:])]
    return torch.cat(pieces, dim=1).transpose(0, 1).reshape(batch, length, heads, dim), None


@pytest.mark.parametrize("backend,window", [("sdpa", 16), ("sdpa", 2048), ("eager", 16), ("eager", 2048),
                                            (VARLEN, 0)])
def test_packed_rows_equal_every_document_alone(backend, window, monkeypatch):
    monkeypatch.setattr(attention, "DOCUMENT_WINDOW", window)
    model = tiny_llama("sdpa" if backend == VARLEN else backend)
    if backend == VARLEN:
        AttentionInterface.register(VARLEN, varlen_reference_backend)
        model.set_attn_implementation(VARLEN)
        monkeypatch.setattr(documents, "is_varlen", lambda name: name == VARLEN)
    feature = PackedDocuments(None)
    feature.build(model, None)
    ids = input_ids()
    inputs = feature.transform({"input_ids": ids, "position_ids": positions()})
    weights = torch.randn(2, LENGTH, 97, generator=torch.Generator().manual_seed(2))
    logits, grads = logits_and_grads(model, inputs, weights)
    expected_logits, expected_grads = documents_alone(model, ids, weights)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-5, msg=name)


def packed_features(name: str):
    """(the feature that keeps documents apart, the state its build takes): PackedDocuments, or the Ulysses wrapper
    on a single cp rank (its all-to-all the identity)."""
    if name == "documents":
        return PackedDocuments(None), None
    return ulysses.ContextParallel(None), types.SimpleNamespace(cp_size=1, cp_rank=0, cp_all_to_all=lambda send: send)


@pytest.mark.parametrize("feature_name", ["documents", "ulysses"])
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_compiled_layers_attend_the_same_spans(backend, feature_name, monkeypatch):
    """Under torch.compile (aot_eager: the graphs as inductor gets them, forward and backward, run by eager
    kernels), sdpa attends the spans inside document_sdpa and eager the whole row with its documents' mask, on one
    rank and inside the Ulysses wrapper: the logits and gradients of the uncompiled layers, no graph break, and no
    layer compiled again for a second layout of documents (and a second row length)."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(attention, "DOCUMENT_WINDOW", 16)
    model = tiny_llama(backend)
    feature, state = packed_features(feature_name)
    feature.build(model, state)
    ids = input_ids()

    def transform(ids, positions):
        inputs = feature.transform({"input_ids": ids, "shift_labels": ids, "position_ids": positions})
        inputs.pop("shift_labels")
        return inputs

    inputs = transform(ids, positions())
    weights = torch.randn(2, LENGTH, 97, generator=torch.Generator().manual_seed(2))
    expected = logits_and_grads(model, inputs, weights)
    torch._dynamo.reset()
    counters.clear()
    calls = count_attention_forwards(monkeypatch)
    compiled_as_uncompiled(model, inputs, weights, expected, monkeypatch)
    # The forward of each of the 2 layers, once: the backward is the kernels' own.
    assert len(calls) == (2 if backend == "sdpa" else 0)
    # Other documents in rows of another length: the same graph.
    other = torch.cat([torch.arange(n) for n in (3, 30, 7)]).repeat(2, 1)
    logits_and_grads(model, transform(ids[:, :40], other), weights[:, :40])
    assert dict(counters["graph_break"]) == {} and counters["stats"]["unique_graphs"] == 1


def test_flex_attention_builds_one_document_block_mask_a_micro_batch_compiled_or_not(monkeypatch):
    """flex attention's BlockMask of the packed documents: built once a micro-batch by the model's forward
    (transformers' mask creation) and handed to every layer, whose compiled code reuses it; the documents kept
    apart (a forward: flex attention has no backward on CPU)."""
    import transformers.masking_utils as masking

    built = []
    create = masking.create_block_mask
    monkeypatch.setattr(masking, "create_block_mask", lambda *args, **kwargs: built.append(1) or create(*args,
                                                                                                          **kwargs))
    model = tiny_llama("flex_attention").eval()
    ids = input_ids()
    weights = torch.zeros(2, LENGTH, 97)
    expected, _ = documents_alone(tiny_llama("sdpa"), ids, weights)
    outputs = []
    for compiled in (False, True):
        if compiled:
            torch._dynamo.reset()
            for layer in model.model.layers:
                compile_layer(layer)
        built.clear()
        with torch.no_grad():
            outputs.append(model(input_ids=ids, position_ids=positions(), use_cache=False).logits)
        assert len(built) == 1
    for logits in outputs:
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def compiled_as_uncompiled(model, inputs, weights, expected, monkeypatch) -> None:
    """The model's layers compiled (aot_eager: the graphs as inductor gets them, run by eager kernels) give the
    (logits, gradients) `expected` of the uncompiled ones."""
    compile_with_backend(monkeypatch, "aot_eager")
    for layer in model.model.layers:
        compile_layer(layer)
    logits, grads = logits_and_grads(model, inputs, weights)
    torch.testing.assert_close(logits, expected[0], rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[1][name], rtol=1e-5, atol=1e-5, msg=name)


def count_attention_forwards(monkeypatch) -> list:
    """The calls of document_sdpa's forward from here on, each the shape of its spans."""
    calls = []
    forward = attention._spans_forward

    def counted(*args):
        calls.append(args[4].shape)
        return forward(*args)

    monkeypatch.setattr(attention, "_spans_forward", counted)
    return calls


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_a_compiled_layer_runs_its_attention_forward_once_a_step_twice_under_full_checkpointing(checkpointing,
                                                                                                 monkeypatch):
    """A step's attention forwards under torch.compile (aot_eager), each layer's: 1, 2 where full checkpointing
    recomputes the layer, 1 under selective (attention's output kept); the gradients those of the uncompiled
    layers."""
    from llmtune.model.checkpointing import enable_checkpointing

    monkeypatch.setattr(attention, "DOCUMENT_WINDOW", 16)
    model = tiny_llama("sdpa")
    feature, state = packed_features("documents")
    feature.build(model, state)
    inputs = feature.transform({"input_ids": input_ids(), "position_ids": positions()})
    weights = torch.randn(2, LENGTH, 97, generator=torch.Generator().manual_seed(2))
    expected = logits_and_grads(model, inputs, weights)
    if checkpointing != "none":
        enable_checkpointing(model, checkpointing)
    torch._dynamo.reset()
    calls = count_attention_forwards(monkeypatch)
    compiled_as_uncompiled(model, inputs, weights, expected, monkeypatch)
    assert len(calls) == len(model.model.layers) * (2 if checkpointing == "full" else 1)


@pytest.mark.parametrize("backend", ["sdpa", "eager", VARLEN])
def test_the_ulysses_wrapper_hands_the_backend_the_full_sequences_documents(backend, monkeypatch):
    """Context parallelism's attention on a single cp rank (its all-to-all the identity): what it gives the inner
    backend (document positions for sdpa/eager, cu_seq_lens for a varlen one) keeps the documents apart."""
    monkeypatch.setattr(attention, "DOCUMENT_WINDOW", 16)
    model = tiny_llama("sdpa" if backend == VARLEN else backend)
    if backend == VARLEN:
        AttentionInterface.register(VARLEN, varlen_reference_backend)
        model.set_attn_implementation(VARLEN)
        monkeypatch.setattr(ulysses, "is_varlen", lambda name: name == VARLEN)
    feature = ulysses.ContextParallel(None)
    feature.build(model, types.SimpleNamespace(cp_size=1, cp_rank=0, cp_all_to_all=lambda send: send))
    ids = input_ids()
    inputs = feature.transform({"input_ids": ids, "shift_labels": ids, "position_ids": positions()})
    inputs.pop("shift_labels")
    weights = torch.randn(2, LENGTH, 97, generator=torch.Generator().manual_seed(2))
    logits, grads = logits_and_grads(model, inputs, weights)
    model.set_attn_implementation("sdpa")
    expected_logits, expected_grads = documents_alone(model, ids, weights)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-5, msg=name)


def test_no_mask_beyond_the_window_is_built(monkeypatch):
    monkeypatch.setattr(attention, "DOCUMENT_WINDOW", 16)
    masks = []
    sdpa = F.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, **kwargs):
        masks.append(None if attn_mask is None else attn_mask.shape)
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    model = tiny_llama("sdpa")
    feature = PackedDocuments(None)
    feature.build(model, None)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    model(**feature.transform({"input_ids": input_ids(), "position_ids": positions()}), use_cache=False)
    # Per layer, row 0: spans (0,5) (5,28) (28,30) (30,60) (60,64); row 1: (0,40) (40,51) (51,64).
    assert len(masks) == 2 * 8
    assert all(shape is None or shape[-1] <= 16 for shape in masks)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_rows_are_attended_in_fp32_on_cpu(dtype, monkeypatch):
    """The backend sees fp32 query, key and value and the output comes back in the inputs' dtype: equal, up to its
    rounding, to fp32 attention of the same (rounded) inputs."""
    monkeypatch.setattr(attention, "DOCUMENT_WINDOW", 16)
    seen = []
    sdpa = attention.backend_function(None, "sdpa")

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append(query.dtype)
        return sdpa(module, query, key, value, attention_mask, **kwargs)

    generator = torch.Generator().manual_seed(3)
    query, key, value = (torch.randn(2, 4, LENGTH, 8, generator=generator).to(dtype).requires_grad_()
                         for _ in range(3))
    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=1, training=False)
    out = attention.attend(spy, module, query, key, value, positions(), None, False, 16)
    assert out.dtype == dtype and set(seen) == {torch.float32}
    reference = attention.attend(sdpa, module, query.float(), key.float(), value.float(), positions(), None, False, 16)
    torch.testing.assert_close(out, reference.to(dtype), rtol=0, atol=0)
    out.float().sum().backward()
    assert query.grad.dtype == dtype


def test_document_mask_off_attends_across_the_row_as_transformers_does():
    ids = input_ids()
    inputs = {"input_ids": ids, "position_ids": positions(), "attention_mask": torch.ones_like(ids)}
    reference = tiny_llama("sdpa")
    expected = reference(**inputs, use_cache=False).logits
    model = tiny_llama("sdpa")
    feature = PackedDocuments(None)
    feature.build(model, None)
    torch.testing.assert_close(model(**feature.transform(inputs), use_cache=False).logits, expected)


def test_varlen_boundaries_lay_the_rows_end_to_end():
    kwargs = varlen_kwargs(positions())
    expected = [0, 5, 28, 30, 60, 64, 104, 105, 115, 124, 128]
    assert kwargs["cu_seq_lens_q"].tolist() == expected and kwargs["cu_seq_lens_k"].tolist() == expected
    assert kwargs["cu_seq_lens_q"].dtype == torch.int32
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 40
    # A row that is one document (no restart) is one segment, even when its positions do not start at 0.
    assert varlen_kwargs(torch.arange(3, 11).expand(2, 8))["cu_seq_lens_q"].tolist() == [0, 8, 16]


def flash_attention_missing() -> bool:
    from transformers.utils import is_flash_attn_2_available

    return not (torch.cuda.is_available() and is_flash_attn_2_available())


@pytest.mark.cuda
@pytest.mark.skipif(flash_attention_missing(), reason="flash attention's varlen kernels need a CUDA device and "
                                                      "flash-attn")
def test_flash_attention_on_packed_rows_equals_every_document_alone_on_cuda():
    """The real varlen kernel, in bf16: what PackedDocuments hands it keeps the documents of two rows apart."""
    model = tiny_llama("flash_attention_2").to("cuda", torch.bfloat16)
    feature = PackedDocuments(None)
    feature.build(model, None)
    ids = input_ids().cuda()
    inputs = feature.transform({"input_ids": ids, "position_ids": positions().cuda()})
    weights = torch.randn(2, LENGTH, 97, generator=torch.Generator().manual_seed(2)).cuda()
    logits, grads = logits_and_grads(model, inputs, weights)
    model.set_attn_implementation("sdpa")
    expected_logits, expected_grads = documents_alone(model, ids, weights)
    # bf16 kernels that round differently: within a few bf16 ulps of the logits' scale.
    torch.testing.assert_close(logits, expected_logits, rtol=2e-2, atol=2e-2)
    for name, grad in grads.items():
        scale = expected_grads[name].abs().max().item()
        torch.testing.assert_close(grad, expected_grads[name], rtol=5e-2, atol=5e-2 * scale, msg=name)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="document_sdpa's CUDA kernels need a CUDA device")])])
@pytest.mark.parametrize("sliding_window", [None, 12])
@pytest.mark.parametrize("rows", ["documents", "branched"])
def test_document_sdpa_gives_sdpas_outputs_and_gradients(device, sliding_window, rows):
    """document_sdpa's kernels and their backward span by span (CPU flash attention; CUDA memory-efficient
    attention, its masks padded as sdpa pads them) against sdpa over each row with its documents' mask, fp32: rows
    of several spans, spans of one document (the causal kernel) and of several; BRANCHED's stems and forks (a
    stem's keys and values given their forks' gradients too)."""
    host = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in ((20, 3, 9, 32), (40, 24))]) \
        if rows == "documents" else branched_positions()
    spans, positions_on = attention.document_spans(host, 16), host.to(device)
    generator = torch.Generator(device=device).manual_seed(0)
    query, key, value = (torch.randn(len(host), 4, LENGTH, 16, device=device, generator=generator,
                                     requires_grad=True) for _ in range(3))
    out = attention.document_sdpa(query, key, value, positions_on, spans, None, sliding_window)[0]
    grad = torch.randn(out.shape, device=device, generator=generator)
    found = torch.autograd.grad(out, (query, key, value), grad)
    mask = attention._mask(positions_on, sliding_window, False, torch.float32, False)
    expected_out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask).transpose(1, 2)
    expected = torch.autograd.grad(expected_out, (query, key, value), grad)
    torch.testing.assert_close(out, expected_out, rtol=1e-4, atol=1e-4)
    for got, want in zip(found, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# Rows whose documents have branches (data/collate.share_prefix): (length, start position) of each segment; a segment
# starting mid-row above position 0 goes on from its document's first segment's token before that position. The
# third row's first document is a grpo group's (two branches from the first segment's last token), its second has
# branches from two positions: with a window of 16, the documents of one branch position are cut into a stem and
# forks (attention.fork_cuts), the other is attended with its mask.
BRANCHED = [[(20, 0), (7, 8), (14, 0), (10, 5), (13, 0)], [(30, 0), (12, 1), (22, 0)],
            [(24, 0), (8, 23), (8, 23), (10, 0), (7, 3), (7, 6)]]


def branched_positions() -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(start, start + n) for n, start in row]) for row in BRANCHED])


def sequences_alone(model, ids, weights):
    """The reference for BRANCHED: every document's first segment run alone, and every branch run alone after the
    first segment's tokens before it; each packed token's logits are those of its own sequence."""
    model.zero_grad()
    rows = []
    for row, segments in enumerate(BRANCHED):
        index, pieces, trunk = 0, [], None
        for n, start in segments:
            if start == 0:
                trunk = ids[row:row + 1, index:index + n]
                sequence = trunk
            else:
                sequence = torch.cat([trunk[:, :start], ids[row:row + 1, index:index + n]], dim=1)
            pieces.append(model(input_ids=sequence, use_cache=False).logits[:, start:])
            index += n
        rows.append(torch.cat(pieces, dim=1))
    logits = torch.cat(rows)
    (logits * weights).sum().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("feature_name", ["documents", "ulysses"])
@pytest.mark.parametrize("backend,window", [("sdpa", 16), ("sdpa", 40), ("sdpa", 2048), ("eager", 16),
                                            ("eager", 2048)])
def test_a_branch_attends_to_its_documents_shared_beginning_as_its_sequence_alone(backend, window, feature_name,
                                                                                 monkeypatch):
    """A branch sees its document's first segment's tokens below its first position, then itself, and nothing else
    (not the rest of the first segment, not another document): each token's logits and every gradient are those of
    its own sequence run alone, whatever the spans the rows are cut into; the feature says it keeps such rows."""
    monkeypatch.setattr(attention, "DOCUMENT_WINDOW", window)
    model = tiny_llama(backend)
    feature, state = packed_features(feature_name)
    feature.build(model, state)
    assert feature.keeps_shared_prefixes
    ids = input_ids(len(BRANCHED))
    inputs = feature.transform({"input_ids": ids, "shift_labels": ids, "position_ids": branched_positions()})
    inputs.pop("shift_labels")
    weights = torch.randn(len(BRANCHED), LENGTH, 97, generator=torch.Generator().manual_seed(2))
    logits, grads = logits_and_grads(model, inputs, weights)
    model.set_attn_implementation(backend)
    expected_logits, expected_grads = sequences_alone(model, ids, weights)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("eager", [False, True])
def test_the_mask_of_a_branched_stretch_counts_the_sliding_window_in_positions(eager):
    """The one mask of a whole row (compiled layers, eager attention): a token sees what its sequence alone would
    see within the window, counted in positions: a branch's first token at position 8 sees the first segment's
    positions 5-7 with a window of 4, though they lie 20 tokens back in the row."""
    row = torch.tensor([list(range(20)) + list(range(8, 15))])
    mask = attention._mask(row, 4, eager, torch.float32, False)
    allowed = mask[0, 0] == 0 if eager else mask[0, 0]
    assert allowed[20].nonzero().flatten().tolist() == [5, 6, 7, 20]
    assert allowed[26].nonzero().flatten().tolist() == [23, 24, 25, 26]
    assert allowed[19].nonzero().flatten().tolist() == [16, 17, 18, 19]


def test_a_long_document_whose_branches_go_on_from_one_position_is_cut_into_its_stem_and_forks():
    """BRANCHED with a window of 16: each document longer than the window with one branch position is its first
    segment's tokens below it (causal alone), then forks (the first segment's rest, each branch) that attend to that
    stem; the third row's second document, branched from positions 3 and 6, keeps its mask."""
    one, fork, several = attention.SPAN_OF_ONE, attention.SPAN_OF_FORK, attention.SPAN_OF_SEVERAL
    assert attention._cut(attention.document_spans(branched_positions(), 16)) == [
        [(0, 8, one), (8, 20, fork), (20, 27, fork), (27, 32, one), (32, 41, fork), (41, 51, fork), (51, 64, one)],
        [(0, 1, one), (1, 30, fork), (30, 42, fork), (42, 64, one)],
        [(0, 23, one), (23, 24, fork), (24, 32, fork), (32, 40, fork), (40, 64, several)]]


def test_a_varlen_backend_does_not_keep_shared_prefixes(monkeypatch):
    """flash attention's kernels end a document at every segment: the feature says so, and rm then packs each pair's
    sequences whole."""
    model = tiny_llama("sdpa")
    AttentionInterface.register(VARLEN, varlen_reference_backend)
    model.set_attn_implementation(VARLEN)
    monkeypatch.setattr(documents, "is_varlen", lambda name: name == VARLEN)
    feature = PackedDocuments(None)
    feature.build(model, None)
    assert feature.keeps_shared_prefixes is False


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_compiled_layers_attend_a_branch_as_its_sequence_alone(backend, monkeypatch):
    """Under torch.compile (aot_eager) a branched row's logits and gradients are still those of each sequence alone:
    sdpa's spans inside document_sdpa, eager's mask built inside the compiled layer; no graph break."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(attention, "DOCUMENT_WINDOW", 16)
    model = tiny_llama(backend)
    feature = PackedDocuments(None)
    feature.build(model, None)
    ids = input_ids(len(BRANCHED))
    inputs = feature.transform({"input_ids": ids, "position_ids": branched_positions()})
    weights = torch.randn(len(BRANCHED), LENGTH, 97, generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    counters.clear()
    compile_with_backend(monkeypatch, "aot_eager")
    for layer in model.model.layers:
        compile_layer(layer)
    logits, grads = logits_and_grads(model, inputs, weights)
    expected_logits, expected_grads = sequences_alone(tiny_llama(backend), ids, weights)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-5, msg=name)
    assert dict(counters["graph_break"]) == {}


# Images attended both ways (Gemma 3's) inside DOCUMENTS' documents: [start, end) of each image's tokens per row; two
# in one document, one longer than the window, one longer than the sliding window, one in a document of its own span.
IMAGES = [[(1, 4), (8, 20), (21, 26), (35, 55)], [(2, 30), (43, 48)]]


def image_blocks() -> torch.Tensor:
    """transformers' own numbering of the images' tokens (Gemma 3's get_block_sequence_ids_for_mask)."""
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    types = torch.zeros(len(IMAGES), LENGTH, dtype=torch.int)
    for row, images in enumerate(IMAGES):
        for start, end in images:
            types[row, start:end] = 1
    return get_block_sequence_ids_for_mask(types)


def images_alone(query, key, value, blocks, sliding_window):
    """The reference: every document attended alone under the mask transformers composes for Gemma 3: causal OR
    the document's image blocks, AND the sliding window."""
    from transformers.masking_utils import and_masks, blockwise_overlay, causal_mask_function, or_masks, \
        sliding_window_overlay

    rows = []
    for row, lengths in enumerate(DOCUMENTS):
        start, pieces = 0, []
        for n in lengths:
            allowed = or_masks(causal_mask_function, blockwise_overlay(blocks[row:row + 1, start:start + n]))
            if sliding_window:
                allowed = and_masks(allowed, sliding_window_overlay(sliding_window))
            index = torch.arange(n)
            mask = allowed(torch.tensor(0), torch.tensor(0), index[:, None], index[None, :])
            pieces.append(F.scaled_dot_product_attention(*(t[row:row + 1, :, start:start + n] for t in
                                                           (query, key, value)), attn_mask=mask))
            start += n
        rows.append(torch.cat(pieces, dim=2))
    return torch.cat(rows).transpose(1, 2)


@pytest.mark.parametrize("backend,window,sliding_window,compiled", [
    ("sdpa", 16, None, False), ("sdpa", 2048, None, False), ("sdpa", 16, 4, False), ("eager", 16, 4, False),
    ("eager", 2048, None, False), ("sdpa", 16, 4, True), ("eager", 16, 4, True)])
def test_image_blocks_attend_both_ways_within_their_image_and_document(backend, window, sliding_window, compiled,
                                                                      monkeypatch):
    """Gemma 3's image tokens, packed: each sees every token of its own image, the later ones too, inside the
    sliding window, and every token its document alone gives it, whatever the spans; compiled (aot_eager), sdpa's
    spans inside document_sdpa and eager's mask of the row: the same outputs and gradients."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    monkeypatch.setattr(attention, "DOCUMENT_WINDOW", window)
    function = eager_attention_forward if backend == "eager" else attention.backend_function(None, "sdpa")
    module = attention.AttentionHeads(1)
    generator = torch.Generator().manual_seed(4)
    query, key, value = (torch.randn(2, 2, LENGTH, 8, generator=generator, requires_grad=True) for _ in range(3))
    blocks = image_blocks()
    spans = attention.document_spans(positions(), window, blocks)

    def attend(query, key, value, positions, spans, blocks):
        return attention.attend(function, module, query, key, value, positions, sliding_window, backend == "eager",
                                window, spans, blocks, scaling=8 ** -0.5)

    if compiled:
        torch._dynamo.reset()
        attend = torch.compile(attend, backend="aot_eager", fullgraph=True)
    out = attend(query, key, value, positions(), spans, blocks)
    expected = images_alone(query, key, value, blocks, sliding_window)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    weights = torch.randn(out.shape, generator=generator)
    grads = torch.autograd.grad((out * weights).sum(), (query, key, value))
    for grad, reference in zip(grads, torch.autograd.grad((expected * weights).sum(), (query, key, value))):
        torch.testing.assert_close(grad, reference, rtol=1e-5, atol=1e-5)
