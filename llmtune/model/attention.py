"""The attention backend of a run, and attention over packed documents that never builds a mask of the whole row.

Backends are transformers' own (config.ATTENTION_BACKENDS and Hub kernels, org/name, which transformers loads
through the `kernels` package); `auto` picks flash attention on a CUDA device that has it, else sdpa.

Packed rows hold several documents, their position_ids restarting at each (data/packing.py). Each document must
attend to itself alone, and how the backend learns the boundaries decides what it costs:
- varlen backends (flash attention, Hub kernels) are given the boundaries as `cu_seq_lens_q/k` and
  `max_length_q/k` over the micro-batch's rows laid end to end (`varlen_kwargs`), and build no mask at all.
  transformers finds them from position_ids by itself only when a micro-batch has one row: with more, flash
  attention would attend across documents, silently.
- sdpa and eager attend document span by span (`attend`): each span holds whole documents up to DOCUMENT_WINDOW
  tokens, or one longer document, so no mask is larger than the window's square, where transformers' mask of the
  row grows with the square of the row (5.3 GiB for 16k packed tokens on one rank), and most of the attention
  runs in sdpa's causal kernels, which take no mask. Under train.compile, sdpa attends the same spans inside one
  custom operator (`document_sdpa`), which torch.compile calls without tracing it: the cut into spans is Python
  control flow on host values, which a traced graph would be specialised on, compiling every layer again for each
  new layout of documents. Eager attention under compile (and sdpa with dropout) attends each row in one call with
  its documents' mask, built inside the compiled layer from the positions.

The documents a micro-batch keeps apart are read from one [b, S] tensor (`document_positions`): the row's
position_ids when the rows are packed with document masks (no attention_mask), else a plain count, one document
per row (rows padded on the right need no mask: a real token never attends to the pads after it, and the pads
carry no label). Where the spans lie, and which hold one document, `attend` takes from a [b, S] tensor kept in host
memory (`document_spans`, made by the features' transform from the host copy of those positions): found from the
device tensor in every layer, each would make the host wait for the device.

A family whose image tokens attend to each other both ways (Gemma 3) adds a second [b, S] tensor, `image_blocks`:
each token's image block (transformers' block_sequence_ids: one number per run of an image's tokens, -1 on text),
within which attention goes both ways on top of the causal one, inside the sliding window as transformers composes
them (`_mask`). A span holding image tokens is then attended with its mask.
"""

import sys

import torch
from transformers.integrations.sdpa_attention import repeat_kv

from llmtune.config import HUB_KERNEL
from llmtune.model import varlen

DOCUMENTS = "llmtune_documents"
# Longest stretch of a row that one sdpa/eager call (and one mask) covers; see `attend`. Short: a document of this
# length or more is attended alone, by sdpa's causal kernel without a mask, and only shorter neighbours share a
# call and a small mask. benchmarks/throughput.py --sft (instruction-like lengths packed in rows of 2,048, one CPU
# process): packing with document masks ran at 0.85x the speed of packing without them with a window of 2,048
# (one masked call per row), and at 1.15x with 256 (less work than attending across the row).
DOCUMENT_WINDOW = 256


def is_varlen(backend: str | None) -> bool:
    """Whether the backend runs flash attention's variable-length kernels (it takes cu_seq_lens, no mask): flash-attn's,
    a Hub kernel's, or torch's own (varlen)."""
    return backend is not None and (backend.startswith("flash_attention") or backend == varlen.VARLEN
                                    or bool(HUB_KERNEL.match(backend)))


def backend_problems(backend: str | None, cuda: bool, bf16: bool) -> list[str]:
    """What stops the recipe's backend from training on this machine, before anything is built: flash attention
    and Hub kernels need a CUDA device, bf16 compute and their package; flex attention has no backward on CPU."""
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available, is_kernels_available

    key = f"model.attn_implementation: {backend}"
    if backend == "flex_attention" and not cuda:
        return [f"{key} cannot train on CPU (torch has no flex attention backward there); use sdpa"]
    if not is_varlen(backend):
        return []
    if not cuda:
        return [f"{key} needs a CUDA device and this machine has none; use auto (sdpa here) or sdpa"]
    problems = []
    if not bf16:
        problems.append(f"{key} computes in bf16 or fp16 only; set train.bf16 (or fp16): true, or use sdpa")
    if backend == varlen.VARLEN:
        return problems + ([] if varlen.available() else [
            f"{key} needs torch.nn.attention.varlen, which torch {torch.__version__} lacks; use sdpa, or torch 2.10 "
            "or later"])
    packages = {"flash_attention_2": (is_flash_attn_2_available, "flash-attn"),
                "flash_attention_3": (is_flash_attn_3_available, "flash-attn-3 (flash_attn_interface)")}
    available, package = packages.get(backend, (lambda: False, None))
    # Without flash-attn, transformers fetches the same kernels from the Hub through `kernels`.
    if not (available() or is_kernels_available()):
        wanted = f"{package}, or kernels (transformers then loads the kernel from the Hub)" if package else "kernels"
        problems.append(f"{key} needs a package this environment lacks: pip install {wanted}")
    return problems


def resolve_backend(requested: str, model_config, cuda: bool, bf16: bool) -> str | None:
    """transformers' name for the recipe's backend. `auto`: flash attention 3 on Hopper, else 2, where the
    package is installed, the run computes in bf16 and the model class supports it; without flash-attn, torch's
    own varlen kernels (no package, no mask); otherwise None, which lets transformers pick (sdpa where the class has
    it, else eager)."""
    if requested != "auto":
        return requested
    if not (cuda and bf16 and _supports_flash(model_config)):
        return None
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    if is_flash_attn_3_available() and torch.cuda.get_device_capability()[0] == 9:
        return "flash_attention_3"
    if is_flash_attn_2_available():
        return "flash_attention_2"
    return varlen.VARLEN if varlen.available() else None


def _supports_flash(model_config) -> bool:
    from transformers import AutoModelForCausalLM

    try:
        model_class = AutoModelForCausalLM._model_mapping[type(model_config)]
    except KeyError:  # a class from the model's own code: transformers' default is the safe pick
        return False
    return bool(getattr(model_class, "_supports_flash_attn", False))


def document_positions(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """[b, S] positions whose restarts delimit the documents the attention keeps apart (see the module's doc)."""
    if "position_ids" in inputs and "attention_mask" not in inputs:
        return inputs["position_ids"]
    input_ids = inputs["input_ids"]
    return torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape)


def segment_starts(positions: torch.Tensor) -> torch.Tensor:
    """For each token of [b, s] position_ids: True where a segment starts, the positions not going on by one; the
    first token of every row starts one."""
    return torch.diff(positions, dim=1, prepend=positions[:, :1]) != 1


def document_starts(positions: torch.Tensor) -> torch.Tensor:
    """For each token of [b, s] position_ids: True where a document starts: the positions restart at 0, or the row
    begins. A segment that starts mid-row at position p > 0 is a branch of the document before it (the rejected
    sequence of an rm pair whose prompt the chosen one holds, data/collate.share_prefix): it attends to that
    document's first segment's tokens at positions below p, then to itself (`_mask`)."""
    starts = segment_starts(positions)
    starts[:, 1:] &= positions[:, 1:] == 0
    return starts


def varlen_kwargs(positions: torch.Tensor) -> dict:
    """What flash attention's variable-length kernels take for [b, S] document positions: the offsets of every
    document in the rows laid end to end (int32, as the kernels take them) and the longest document."""
    starts = segment_starts(positions).flatten().nonzero().flatten()
    bounds = torch.cat([starts, starts.new_tensor([positions.numel()])]).to(torch.int32)
    longest = int(bounds.diff().max())
    return {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": longest, "max_length_k": longest}


# What document_spans holds where a span starts (0 elsewhere): the span needs a mask (it holds several documents,
# a branch or an image attended both ways), one document's causal attention is all it takes, or it is a fork of the
# stem span before it (`fork_cuts`): its tokens attend to the whole stem, then causally to themselves.
SPAN_OF_SEVERAL, SPAN_OF_ONE, SPAN_OF_FORK = 1, 2, 3


def document_spans(positions: torch.Tensor, window: int | None = None,
                   image_blocks: torch.Tensor | None = None) -> torch.Tensor:
    """How `attend` cuts the rows of [b, S] document positions (the host copy: read here) for `window` (None:
    DOCUMENT_WINDOW): an int8 tensor of their shape, 0 but where a span starts, SPAN_OF_ONE or SPAN_OF_SEVERAL by
    the mask it needs. A row no longer than the window is one span; a longer one is cut by document_windows.
    A tensor, not Python values: torch.compile passes it to document_sdpa as it passes any tensor, where values
    would be guarded on, and compiled again for at every new layout. `image_blocks` (the host copy): a span holding
    an image attended both ways needs a mask, as one of several documents does."""
    window = DOCUMENT_WINDOW if window is None else window
    # One document in one segment needs no mask; a branch needs one as several documents do.
    starts = segment_starts(positions)
    images = torch.zeros_like(starts) if image_blocks is None else image_blocks >= 0
    spans = torch.zeros(positions.shape, dtype=torch.int8)
    if positions.shape[1] <= window:
        spans[:, 0] = torch.where(starts[:, 1:].any(dim=1) | images.any(dim=1), SPAN_OF_SEVERAL, SPAN_OF_ONE)
        return spans
    for row, row_positions in enumerate(positions):
        for start, end in document_windows(row_positions, window):
            # A span longer than the window holds one document: one with branches is cut into its stem and forks.
            forks = fork_cuts(row_positions[start:end]) if end - start > window and not images[row, start:end].any() \
                else []
            if forks:
                spans[row, start] = SPAN_OF_ONE
                spans[row, [start + cut for cut in forks]] = SPAN_OF_FORK
                continue
            masked = starts[row, start + 1:end].any() or images[row, start:end].any()
            spans[row, start] = SPAN_OF_SEVERAL if masked else SPAN_OF_ONE
    return spans


def fork_cuts(positions: torch.Tensor) -> list[int]:
    """Where one document's [s] positions (host values) are cut into a stem and its forks, [] where they are not: a
    document whose branches all go on from one position p (a grpo group's completions, a dpo pair's answers) is the
    first segment's tokens below p (the stem, causal alone), then each fork: the first segment's rest and every
    branch, each attending to the whole stem and causally to itself. Each fork's attention then costs its length x
    (the stem's + its own) instead of a share of the document's square under one mask. Branches from several
    positions keep the mask."""
    segments = segment_starts(positions[None])[0].nonzero().flatten().tolist()
    if len(segments) < 2 or len({int(positions[start]) for start in segments[1:]}) > 1:
        return []
    stem = int(positions[segments[1]]) - int(positions[0])  # the first segment's tokens below the branches' position
    if not 0 < stem <= segments[1]:
        return []
    return [stem] * (stem < segments[1]) + segments[1:]


def _cut(spans: torch.Tensor) -> list[list[tuple[int, int, int]]]:
    """Row by row, the (start, end, kind) of each span of a document_spans tensor."""
    rows = [[] for _ in range(spans.shape[0])]
    for (row, start), kind in zip(spans.nonzero().tolist(), spans[spans != 0].tolist()):
        rows[row].append((start, kind))
    ends = ([start for start, _ in row[1:]] + [spans.shape[1]] for row in rows)
    return [[(start, end, kind) for (start, kind), end in zip(row, row_ends)] for row, row_ends in zip(rows, ends)]


def _mask(positions: torch.Tensor, sliding_window: int | None, eager: bool, dtype: torch.dtype, single: bool,
          image_blocks: torch.Tensor | None = None):
    """Causal, same-document and sliding-window mask over a stretch of a row (`single`: it holds one document of
    one segment and no image attended both ways); None when the backend's own causal attention is all it takes
    (sdpa, one document, no window reached). Eager attention has no causal mode of its own: it always gets one,
    additive.

    A token sees the earlier tokens of its own segment, and a branch's also its document's first segment's tokens
    at positions below the branch's first (document_starts): the tokens it would see in a row of its own, the
    document's shared beginning followed by the branch. An image token also sees every token of its image block
    (`image_blocks`, the stretch's), the later ones too: transformers' OR of the causal mask and the blocks, then
    AND the sliding window. The sliding window counts positions, which inside a segment go on as the indices
    do."""
    length = positions.shape[1]
    if single and not eager and not (sliding_window and length > sliding_window):
        return None
    segments, documents = segment_starts(positions), document_starts(positions)
    index = torch.arange(length, device=positions.device)
    segment, document = segments.cumsum(dim=1), documents.cumsum(dim=1)
    # The position each token's segment starts at, and whether that segment is its document's first.
    start = positions.gather(1, torch.cummax(torch.where(segments, index, 0), dim=1).values)
    trunk = segment == torch.cummax(torch.where(documents, segment, 0), dim=1).values
    seen = (segment[:, :, None] == segment[:, None, :]) | (trunk[:, None, :]
                                                           & (positions[:, None, :] < start[:, :, None]))
    allowed = (index[None, :, None] >= index[None, None, :]) & (document[:, :, None] == document[:, None, :]) & seen
    if image_blocks is not None:
        allowed |= (image_blocks[:, :, None] == image_blocks[:, None, :]) & (image_blocks[:, :, None] >= 0)
    return _finished(allowed, positions, positions, sliding_window, eager, dtype)


def _fork_mask(stem_positions: torch.Tensor, fork_positions: torch.Tensor, sliding_window: int | None, eager: bool,
               dtype: torch.dtype):
    """The mask of a fork's tokens ([1, f] positions) over its stem's ([1, s]) and its own, which go on from each
    other in positions: causal in positions, within the sliding window."""
    key_positions = torch.cat([stem_positions, fork_positions], dim=1)
    allowed = key_positions[:, None, :] <= fork_positions[:, :, None]
    return _finished(allowed, fork_positions, key_positions, sliding_window, eager, dtype)


def _finished(allowed: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor,
              sliding_window: int | None, eager: bool, dtype: torch.dtype):
    """A [b, q, k] boolean mask within the sliding window (counted in positions), with its head dimension, additive
    for eager attention."""
    if sliding_window:
        allowed &= (query_positions[:, :, None] - key_positions[:, None, :]) < sliding_window
    allowed = allowed[:, None]
    return _additive(allowed, dtype) if eager else allowed


def document_windows(positions: torch.Tensor, window: int) -> list[tuple[int, int]]:
    """[start, end) spans of one row's [s] position_ids holding whole documents, consecutive ones grouped up to
    `window` tokens; a longer document has a span of its own."""
    starts = [0, *document_starts(positions[None])[0].nonzero().flatten().tolist()[1:]]
    spans = []
    for start, end in zip(starts, starts[1:] + [len(positions)]):
        if spans and end - spans[-1][0] <= window:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    return spans


def attend(attention, module, query, key, value, positions, sliding_window: int | None, eager: bool, window: int,
           spans: torch.Tensor | None = None, image_blocks: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """`attention` (an sdpa or eager function) over whole rows (query [b, h, S, d], key/value [b, kv, S, d],
    positions [b, S]), causal, within each document and the sliding window -> [b, S, h, d], each image block of
    `image_blocks` [b, S] (if any) both ways. spans: the positions' document_spans for `window` (and image blocks),
    in host memory; None: read here from the positions (a call from outside a training step, where the host then
    waits for the device).

    Each row one span (rows up to `window` tokens, or of one document each): one call for all rows, with one mask
    where a row holds several documents. Otherwise the rows are cut between documents into spans of at most
    `window` tokens (or one longer document), each attended alone: tokens never attend across documents, so the
    result is the same, and a mask never exceeds `window` squared.

    On CPU, bf16 and fp16 inputs are attended in fp32 and the output cast back: torch's CPU attention kernels are
    slower in bf16 than in fp32 (forward and backward, spans up to 512 tokens), and fp32 is the more exact. On the
    19.5M Llama of benchmarks/throughput.py, 8 x 512 tokens, a bf16 step took 0.99 s with bf16 attention and 0.78 s
    with this. CUDA keeps its bf16 kernels.
    """
    if query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16):
        return attend(attention, module, query.float(), key.float(), value.float(), positions, sliding_window, eager,
                      window, spans, image_blocks, **kwargs).to(query.dtype)
    if torch.compiler.is_compiling():
        if spans is not None and not eager and not kwargs.get("dropout") and kwargs.get("position_bias") is None:
            groups = query.shape[1] // key.shape[1]
            return document_sdpa(query, repeat_kv(key, groups), repeat_kv(value, groups), positions, spans,
                                 kwargs.get("scaling"), sliding_window, image_blocks)[0]
        # One masked call over the row (see the module's doc).
        return attention(module, query, key, value,
                         _mask(positions, sliding_window, eager, query.dtype, False, image_blocks), **kwargs)[0]
    if spans is None:
        spans = document_spans(positions.cpu(), window, None if image_blocks is None else image_blocks.cpu())
    cut = _cut(spans)
    if all(len(row) == 1 for row in cut):
        # Longer than the window, a row that is one span holds one document: no mask is larger than the window's.
        single = all(kind == SPAN_OF_ONE for ((_, _, kind),) in cut)
        return attention(module, query, key, value,
                         _mask(positions, sliding_window, eager, query.dtype, single, image_blocks), **kwargs)[0]
    rows = []
    # Cut with unbind and split, whose backward puts the pieces' gradients together in one op: slicing each span
    # out would give every span's gradient the size of the whole batch, zero-filled and summed span after span.
    for row, (*tensors, row_positions, row_spans) in enumerate(zip(query, key, value, positions, cut)):
        lengths = [end - start for start, end, _ in row_spans]
        blocks = [None] * len(lengths) if image_blocks is None else image_blocks[row:row + 1].split(lengths, dim=1)
        pieces = zip(*(t.split(lengths, dim=1) for t in tensors), row_positions.split(lengths), blocks, row_spans)
        outputs, stem = [], None
        for q, k, v, p, b, (_, _, kind) in pieces:
            if kind == SPAN_OF_FORK:  # after the stem's keys and values
                k, v, mask = (torch.cat([stem[0], k], dim=1), torch.cat([stem[1], v], dim=1),
                              _fork_mask(stem[2][None], p[None], sliding_window, eager, query.dtype))
            else:
                stem, mask = (k, v, p), _mask(p[None], sliding_window, eager, query.dtype, kind == SPAN_OF_ONE, b)
            outputs.append(attention(module, q[None], k[None], v[None], mask, **kwargs)[0])
        rows.append(torch.cat(outputs, dim=1))
    return torch.cat(rows)


class AttentionHeads:
    """What a backend's attention function reads of a causal decoder's attention module, for heads attended apart
    from it (the Ulysses wrapper's share of them). A plain class:
    torch.compile cannot build a SimpleNamespace inside a compiled layer, and breaks the layer there."""

    is_causal = True

    def __init__(self, num_key_value_groups: int, training: bool = False, config=None):
        self.num_key_value_groups, self.training, self.config = num_key_value_groups, training, config


def _pieces(positions, spans, sliding_window, image_blocks, dtype) -> list[tuple]:
    """How document_sdpa cuts [b, S] rows as `attend` does: (rows, its queries' columns, the columns of the stem its
    keys and values come after (a fork's; else None), additive mask) of each kernel call, the mask None where the
    causal kernel is all it takes."""
    cut = _cut(spans)
    if all(len(row) == 1 for row in cut):  # every row one span: one call
        single = all(kind == SPAN_OF_ONE for ((_, _, kind),) in cut)
        mask = _mask(positions, sliding_window, False, dtype, single, image_blocks)
        return [(slice(None), slice(None), None, _additive(mask, dtype))]
    pieces = []
    for row, row_spans in enumerate(cut):
        row_positions = positions[row:row + 1]
        for start, end, kind in row_spans:
            if kind == SPAN_OF_FORK:
                mask = _fork_mask(row_positions[:, stem], row_positions[:, start:end], sliding_window, False, dtype)
            else:
                stem = slice(start, end)
                mask = _mask(row_positions[:, start:end], sliding_window, False, dtype, kind == SPAN_OF_ONE,
                             None if image_blocks is None else image_blocks[row:row + 1, start:end])
            pieces.append((slice(row, row + 1), slice(start, end), stem if kind == SPAN_OF_FORK else None,
                           _additive(mask, dtype)))
    return pieces


def _additive(allowed: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask as the kernels below take it: 0 where attended, the dtype's lowest elsewhere."""
    if allowed is None:
        return None
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed,
                                                                                      torch.finfo(dtype).min)


# Memory-efficient attention's (CUDA) logsumexp is padded to a multiple of this many queries, and its bias read at a
# last-dimension stride that is a multiple of 16 (as torch's sdpa pads it).
LSE_ALIGNMENT, BIAS_ALIGNMENT = 32, 16


def _span_forward(query, key, value, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [n, h, s, d], logsumexp [n, h, s] fp32) of one kernel call: the kernels sdpa itself picks, whose
    backward takes these two: CPU flash attention, CUDA memory-efficient attention (which takes a mask)."""
    if query.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, mask is None,
                                                                          attn_mask=mask, scale=scale)
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, _bias(mask, query), True, 0.0, mask is None, scale=scale)
    return out, lse[..., :query.shape[2]]


def _span_backward(grad, query, key, value, out, lse, mask, scale) -> tuple[torch.Tensor, ...]:
    """The gradients w.r.t. query, key and value of one _span_forward call, from its output and logsumexp."""
    if query.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, query, key, value, out, lse, 0.0, mask is None, attn_mask=mask, scale=scale)
    padded = lse.new_zeros(*lse.shape[:2], -(-lse.shape[2] // LSE_ALIGNMENT) * LSE_ALIGNMENT)
    padded[..., :lse.shape[2]] = lse
    unused = torch.zeros((), dtype=torch.int64, device=query.device)  # the dropout's seed and offset: no dropout
    return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad, query, key, value, _bias(mask, query), out, padded, unused, unused, 0.0, [True, True, True, False],
        mask is None, scale=scale)[:3]


def _bias(mask: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor | None:
    """A [n, 1, s, s] mask as memory-efficient attention reads its bias: every head's, at an aligned stride."""
    if mask is None:
        return None
    pad = -mask.shape[-1] % BIAS_ALIGNMENT
    aligned = torch.nn.functional.pad(mask, (0, pad))[..., :mask.shape[-1]] if pad else mask
    return aligned.expand(query.shape[0], query.shape[1], -1, -1)


def _spans_forward(query, key, value, positions, spans, scaling, sliding_window, image_blocks):
    """document_sdpa's (output [b, S, h, d], logsumexp [b, h, S]), span by span."""
    out = query.new_empty(query.shape)
    lse = query.new_empty(query.shape[:3], dtype=torch.float32)
    for rows, columns, stem, mask in _pieces(positions, spans, sliding_window, image_blocks, query.dtype):
        at = (rows, slice(None), columns)
        out[at], lse[at] = _span_forward(query[at], *_after_stem(key, value, rows, columns, stem), mask, scaling)
    return out.transpose(1, 2).contiguous(), lse


def _after_stem(key, value, rows: slice, columns: slice, stem: slice | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A kernel call's keys and values: its columns', after its stem's (a fork's)."""
    if stem is None:
        return key[rows, :, columns], value[rows, :, columns]
    return tuple(torch.cat([t[rows, :, stem], t[rows, :, columns]], dim=2) for t in (key, value))


@torch.library.custom_op("llmtune::document_sdpa", mutates_args=())
def document_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
                  spans: torch.Tensor, scaling: float | None, sliding_window: int | None,
                  image_blocks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """sdpa attention span by span (`attend`'s spans; key/value with as many heads as query) as one operator, which
    torch.compile calls as it is, without tracing the Python that cuts the rows on host values: its output
    [b, S, h, d] and the logsumexp its backward reads. Each span is one call of the kernel sdpa would pick, and its
    backward that kernel's backward: attention runs forward once a step (twice under full checkpointing), as
    uncompiled."""
    return _spans_forward(query, key, value, positions, spans, scaling, sliding_window, image_blocks)


@document_sdpa.register_fake
def _(query, key, value, positions, spans, scaling, sliding_window, image_blocks=None):
    return (query.new_empty(query.shape[0], query.shape[2], query.shape[1], value.shape[3]),
            query.new_empty(query.shape[:3], dtype=torch.float32))


@torch.library.custom_op("llmtune::document_sdpa_backward", mutates_args=())
def _document_sdpa_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor, positions: torch.Tensor, spans: torch.Tensor,
                            scaling: float | None, sliding_window: int | None, image_blocks: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """document_sdpa's gradients, span by span from its output and logsumexp (an operator runs below autograd,
    where torch.autograd would record nothing). Contiguous, as the fake below says: compiled code relies on an
    operator's strides being the fake's."""
    # A stem's keys and values also get their forks' gradients: summed into zeros.
    gradients = [torch.empty_like(query, memory_format=torch.contiguous_format),
                 *(torch.zeros_like(t, memory_format=torch.contiguous_format) for t in (key, value))]
    grad, out = grad.transpose(1, 2), out.transpose(1, 2)
    for rows, columns, stem, mask in _pieces(positions, spans, sliding_window, image_blocks, query.dtype):
        at = (rows, slice(None), columns)
        part_q, *parts = _span_backward(grad[at], query[at], *_after_stem(key, value, rows, columns, stem), out[at],
                                        lse[at], mask, scaling)
        gradients[0][at] = part_q
        for gradient, part in zip(gradients[1:], parts):
            if stem is not None:
                gradient[rows, :, stem] += part[:, :, :stem.stop - stem.start]
                part = part[:, :, stem.stop - stem.start:]
            gradient[at] += part
    return tuple(gradients)


@_document_sdpa_backward.register_fake
def _(grad, query, key, value, out, lse, positions, spans, scaling, sliding_window, image_blocks=None):
    return tuple(t.new_empty(t.shape) for t in (query, key, value))


def _keep_inputs(ctx, inputs, output) -> None:
    query, key, value, positions, spans, ctx.scaling, ctx.sliding_window, image_blocks = inputs
    ctx.images = image_blocks is not None  # save_for_backward takes tensors alone
    ctx.save_for_backward(query, key, value, *output, positions, spans, *([image_blocks] if ctx.images else []))


def _backward(ctx, grad, _):
    query, key, value, out, lse, positions, spans, *blocks = ctx.saved_tensors
    gradients = _document_sdpa_backward(grad, query, key, value, out, lse, positions, spans, ctx.scaling,
                                        ctx.sliding_window, *blocks)
    return *gradients, None, None, None, None, None


document_sdpa.register_autograd(_backward, setup_context=_keep_inputs)


def backend_function(module, backend: str):
    """The attention function the model would call for `backend`: transformers' registered one, or for eager
    the model's own (each modeling file defines it; it is not in the registry)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if backend == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[backend]


def document_attention(module, query, key, value, attention_mask, *, backend: str, dropout: float = 0.0,
                       scaling: float | None = None, sliding_window: int | None = None, document_positions=None,
                       document_spans: torch.Tensor | None = None, image_blocks: torch.Tensor | None = None,
                       **kwargs):
    """The attention function installed for sdpa and eager on one rank per sequence (features/documents.py): the
    backend's attention, document span by span. Its name is not in transformers' mask registry, so the model
    builds no mask and hands it none; the documents come from `document_positions` (and the images attended both
    ways from `image_blocks`), which the feature adds to every micro-batch (a call without them, e.g. a probe of
    the bare model, attends causally over the row)."""
    if document_positions is None:
        document_positions = torch.arange(query.shape[2], device=query.device).expand(query.shape[0], -1)
    out = attend(backend_function(module, backend), module, query, key, value, document_positions, sliding_window,
                 backend == "eager", DOCUMENT_WINDOW, document_spans, image_blocks, dropout=dropout, scaling=scaling,
                 **kwargs)
    return out, None


# What the features add to a micro-batch for the attention of packed documents: a linear-attention layer run on one
# document at a time takes none of them (its kernels would read a row's cu_seq_lens as the document's).
DOCUMENT_INPUTS = frozenset({"document_positions", "document_spans", "document_bounds", "image_blocks",
                             "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"})


def linear_attention_layers(hf_model) -> list:
    """The linear-attention token mixers of the model's layers (`linear_attn`: Qwen3.5's and Qwen3-Next's gated
    delta nets), whose causal convolution and recurrent state run along the whole row: transformers' torch code of
    them takes no document boundaries."""
    return [module for name, module in hf_model.named_modules() if name.rpartition(".")[2] == "linear_attn"]


def document_bounds(positions: torch.Tensor) -> torch.Tensor:
    """Where each document of [b, S] document positions (the host copy) starts: document_spans with every document
    a span of its own, for `by_document`, kept in host memory."""
    return document_spans(positions, 0)


def by_document(forward):
    """A linear-attention layer's forward run on each document of a packed row alone (`document_bounds`): its
    convolution starts from zeros and its state from nothing at every document, as in a row of its own. A
    micro-batch of one document a row (padded, or a call without the bounds) runs whole."""

    def run(hidden_states, *args, document_bounds=None, **kwargs):
        cut = None if document_bounds is None else _cut(document_bounds)
        if cut is None or all(len(row) == 1 for row in cut):
            return forward(hidden_states, *args, **kwargs)
        kwargs = {name: value for name, value in kwargs.items() if name not in DOCUMENT_INPUTS}
        return torch.cat([torch.cat([forward(piece[None], *args, **kwargs)
                                     for piece in states.split([end - start for start, end, _ in row])], dim=1)
                          for states, row in zip(hidden_states, cut)])

    return run
