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
  runs in sdpa's causal kernels, which take no mask. Under train.compile each row is attended in one call with
  its documents' mask (the row's square), built inside the compiled layer from the positions: the cut into spans is
  Python control flow on host values, which torch.compile would specialise on, compiling every layer again for each
  new layout of documents.

The documents a micro-batch keeps apart are read from one [b, S] tensor (`document_positions`): the row's
position_ids when the rows are packed with document masks (no attention_mask), else a plain count, one document
per row (rows padded on the right need no mask: a real token never attends to the pads after it, and the pads
carry no label). Where the spans lie, and which hold one document, `attend` takes from a DocumentLayout read on the
host from the host copy of those positions (`document_layout`, in the features' transform): found from the device
tensor in every layer, each would make the host wait for the device.
"""

import sys
from dataclasses import dataclass

import torch

from llmtune.config import HUB_KERNEL

DOCUMENTS = "llmtune_documents"
# Longest stretch of a row that one sdpa/eager call (and one mask) covers; see `attend`. Short: a document of this
# length or more is attended alone, by sdpa's causal kernel without a mask, and only shorter neighbours share a
# call and a small mask. benchmarks/throughput.py --sft (instruction-like lengths packed in rows of 2,048, one CPU
# process): packing with document masks ran at 0.85x the speed of packing without them with a window of 2,048
# (one masked call per row), and at 1.15x with 256 (less work than attending across the row).
DOCUMENT_WINDOW = 256


def is_varlen(backend: str | None) -> bool:
    """Whether the backend runs flash attention's variable-length kernels (it takes cu_seq_lens, no mask)."""
    return backend is not None and (backend.startswith("flash_attention") or bool(HUB_KERNEL.match(backend)))


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
    package is installed, the run computes in bf16 and the model class supports it; otherwise None, which lets
    transformers pick (sdpa where the class has it, else eager)."""
    if requested != "auto":
        return requested
    if not (cuda and bf16 and _supports_flash(model_config)):
        return None
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    if is_flash_attn_3_available() and torch.cuda.get_device_capability()[0] == 9:
        return "flash_attention_3"
    return "flash_attention_2" if is_flash_attn_2_available() else None


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


def document_starts(positions: torch.Tensor) -> torch.Tensor:
    """For each token of [b, s] position_ids: True where a document starts (the positions restart); the first
    token of every row starts one."""
    return torch.diff(positions, dim=1, prepend=positions[:, :1]) != 1


def varlen_kwargs(positions: torch.Tensor) -> dict:
    """What flash attention's variable-length kernels take for [b, S] document positions: the offsets of every
    document in the rows laid end to end (int32, as the kernels take them) and the longest document."""
    starts = document_starts(positions).flatten().nonzero().flatten()
    bounds = torch.cat([starts, starts.new_tensor([positions.numel()])]).to(torch.int32)
    longest = int(bounds.diff().max())
    return {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": longest, "max_length_k": longest}


@dataclass(frozen=True)
class DocumentLayout:
    """How `attend` cuts a micro-batch's rows, known on the host: `single`, whether the rows, if no longer than the
    window, each hold one document; else `spans`, row by row, the (start, end, one document) of each stretch
    attended at once (document_windows)."""
    single: bool
    spans: tuple[tuple[tuple[int, int, bool], ...], ...] | None = None


def document_layout(positions: torch.Tensor, window: int | None = None) -> DocumentLayout:
    """The DocumentLayout of [b, S] document positions for `window` (None: DOCUMENT_WINDOW), read from them (on the
    host: they should be the host copy)."""
    window = DOCUMENT_WINDOW if window is None else window
    if positions.shape[1] <= window:
        return DocumentLayout(_one_document(positions))
    return DocumentLayout(False, tuple(tuple((start, end, _one_document(row[None, start:end]))
                                             for start, end in document_windows(row, window)) for row in positions))


def layout_kwargs(positions: torch.Tensor, compiled: bool) -> dict:
    """What a micro-batch gives `attend` of its [b, S] host document positions: their DocumentLayout, or nothing
    where the decoder layers are compiled (train.compile), which attend each row in one masked call."""
    return {} if compiled else {"document_layout": document_layout(positions)}


def _one_document(positions: torch.Tensor) -> bool:
    """Whether every row of [b, s] document positions holds one document."""
    return not bool(document_starts(positions)[:, 1:].any())


def _mask(positions: torch.Tensor, sliding_window: int | None, eager: bool, dtype: torch.dtype, single: bool):
    """Causal, same-document and sliding-window mask over a stretch of a row (`single`: it holds one document);
    None when the backend's own causal attention is all it takes (sdpa, one document, no window reached). Eager
    attention has no causal mode of its own: it always gets one, additive."""
    length = positions.shape[1]
    if single and not eager and not (sliding_window and length > sliding_window):
        return None
    documents = document_starts(positions).cumsum(dim=1)
    index = torch.arange(length, device=positions.device)
    allowed = (index[None, :, None] >= index[None, None, :]) & (documents[:, :, None] == documents[:, None, :])
    if sliding_window:
        allowed &= (index[None, :, None] - index[None, None, :]) < sliding_window
    allowed = allowed[:, None]
    if eager:
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed,
                                                                                          torch.finfo(dtype).min)
    return allowed


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
           layout: DocumentLayout | None = None, **kwargs) -> torch.Tensor:
    """`attention` (an sdpa or eager function) over whole rows (query [b, h, S, d], key/value [b, kv, S, d],
    positions [b, S]), causal, within each document and the sliding window -> [b, S, h, d]. layout: the positions'
    document_layout for `window`, None: read here (a call from outside a training step).

    Up to `window` tokens, one call with one mask. Longer rows are cut between documents into spans of at most
    `window` tokens (or one longer document), each attended alone: tokens never attend across documents, so the
    result is the same, and a mask never exceeds `window` squared.

    On CPU, bf16 and fp16 inputs are attended in fp32 and the output cast back: torch's CPU attention kernels are
    slower in bf16 than in fp32 (forward and backward, spans up to 512 tokens), and fp32 is the more exact. On the
    19.5M Llama of benchmarks/throughput.py, 8 x 512 tokens, a bf16 step took 0.99 s with bf16 attention and 0.78 s
    with this. CUDA keeps its bf16 kernels.
    """
    if query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16):
        return attend(attention, module, query.float(), key.float(), value.float(), positions, sliding_window, eager,
                      window, layout, **kwargs).to(query.dtype)
    if torch.compiler.is_compiling():
        # One masked call over the row, whatever its documents (see the module's doc).
        layout = DocumentLayout(False)
    layout = layout or document_layout(positions, window)
    if layout.spans is None:
        return attention(module, query, key, value, _mask(positions, sliding_window, eager, query.dtype,
                                                          layout.single), **kwargs)[0]
    rows = []
    # Cut with unbind and split, whose backward puts the pieces' gradients together in one op: slicing each span
    # out would give every span's gradient the size of the whole batch, zero-filled and summed span after span.
    for *tensors, row_positions, spans in zip(query, key, value, positions, layout.spans):
        lengths = [end - start for start, end, _ in spans]
        pieces = zip(*(t.split(lengths, dim=1) for t in tensors), row_positions.split(lengths), spans)
        rows.append(torch.cat([attention(module, q[None], k[None], v[None],
                                         _mask(p[None], sliding_window, eager, query.dtype, single), **kwargs)[0]
                               for q, k, v, p, (_, _, single) in pieces], dim=1))
    return torch.cat(rows)


def backend_function(module, backend: str):
    """The attention function the model would call for `backend`: transformers' registered one, or for eager
    the model's own (each modeling file defines it; it is not in the registry)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if backend == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[backend]


def document_attention(module, query, key, value, attention_mask, *, backend: str, dropout: float = 0.0,
                       scaling: float | None = None, sliding_window: int | None = None, document_positions=None,
                       document_layout: DocumentLayout | None = None, **kwargs):
    """The attention function installed for sdpa and eager on one rank per sequence (features/documents.py): the
    backend's attention, document span by span. Its name is not in transformers' mask registry, so the model
    builds no mask and hands it none; the documents come from `document_positions`, which the feature adds to
    every micro-batch (a call without them, e.g. a probe of the bare model, attends causally over the row)."""
    if document_positions is None:
        document_positions = torch.arange(query.shape[2], device=query.device).expand(query.shape[0], -1)
    out = attend(backend_function(module, backend), module, query, key, value, document_positions, sliding_window,
                 backend == "eager", DOCUMENT_WINDOW, document_layout, dropout=dropout, scaling=scaling, **kwargs)
    return out, None
