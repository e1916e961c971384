"""Ulysses context parallelism on stock HF models: each of cp ranks holds 1/cp of a sequence's tokens.

A feature (features/base.py) acting at three points:
- check: the model's heads can be spread over the cp ranks; no attention sinks.
- build: installs, through transformers' attention interface, a function that wraps the backend the
  model would use: all-to-all from [sequence shard, all heads] to [full sequence, heads/cp], the
  backend's attention over the full sequence with causal, document and sliding-window masking built
  here, all-to-all back.
- transform: `SequenceShard` cuts every micro-batch: labels were shifted before (each slice keeps the
  label of its last token), the sequence is padded to a multiple of cp with label -100, and every
  rank keeps a contiguous slice of input_ids, labels and GLOBAL position_ids (RoPE sees true
  positions; packed documents keep their restarts), plus the whole sequence's position_ids, which
  the model passes through to every layer's attention.

The mesh (dp_shard x cp, cp peers reading the same batch) is the layout's, in ParallelState; counting
each labelled token once over dp x cp is the trainer's, whatever the feature.

Because the function's name is not in transformers' mask registry, the model hands it no mask;
the mask is built from the full position_ids instead. Right padding needs none: a real token never
attends to the pads after it, and the pads carry no label. Long packed sequences are attended
document span by document span, so that no mask grows with the square of the sequence.
"""

import sys
import types
from functools import partial

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from llmtune.features.base import Feature
from llmtune.loss import IGNORE_INDEX

ATTENTION = "llmtune_ulysses"
# Longest stretch of the full sequence that one attention call (and one mask) covers; see `attend`.
DOCUMENT_WINDOW = 2048


def layout_problems(model_config, cp: int) -> list[str]:
    """What stops this model (its transformers config, whatever names its config.json uses) from running with
    cp ranks per sequence."""
    text = model_config.get_text_config()
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    problems = []
    if heads is None or heads % cp:
        problems.append(f"parallel.cp_size: {cp} does not divide the model's {heads} attention heads; "
                        "choose a cp_size that divides it")
    elif kv_heads % cp and cp % kv_heads:
        problems.append(f"parallel.cp_size: the model's {kv_heads} key/value heads are neither a multiple nor a "
                        f"divisor of cp_size {cp}, so they cannot be spread over the cp ranks")
    if getattr(text, "attention_sinks", None) or text.model_type == "gpt_oss":
        problems.append("parallel.cp_size: attention sinks are not supported with context parallelism")
    return problems


class ContextParallel(Feature):
    name = "context_parallel"

    @staticmethod
    def enabled(config) -> bool:
        return config.parallel.cp_size > 1

    @staticmethod
    def check(config, model_config, world_size: int) -> list[str]:
        return layout_problems(model_config, config.parallel.cp_size)

    def build(self, hf_model, state) -> None:
        hf_model.set_attn_implementation(register_attention(state, hf_model.config._attn_implementation))
        self.shard = SequenceShard(state.cp_size, state.cp_rank)

    def transform(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.shard(inputs)


class SequenceShard:
    """This rank's contiguous slice of every sequence of a micro-batch, and the whole sequence's position_ids
    for the attention (which sees the full sequence and masks it by document)."""

    # Any valid token id pads the sequence to a multiple of cp: the pads come after every real token, which
    # causal attention never lets look ahead, and they carry no label.
    PAD_ID = 0

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank

    def __call__(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        input_ids, labels = inputs["input_ids"], inputs["shift_labels"]
        batch, length = input_ids.shape
        positions = inputs.get("position_ids")
        if positions is None:
            positions = torch.arange(length, device=input_ids.device).expand(batch, length)
        padded = -(-length // self.size) * self.size
        extra = padded - length
        if extra:
            input_ids = F.pad(input_ids, (0, extra), value=self.PAD_ID)
            labels = F.pad(labels, (0, extra), value=IGNORE_INDEX)
            tail = positions[:, -1:] + torch.arange(1, extra + 1, device=positions.device)
            positions = torch.cat([positions, tail], dim=1)
        part = slice(self.rank * padded // self.size, (self.rank + 1) * padded // self.size)
        return {"input_ids": input_ids[:, part].contiguous(), "shift_labels": labels[:, part].contiguous(),
                "position_ids": positions[:, part].contiguous(), "full_position_ids": positions.contiguous()}


class _AllToAll(torch.autograd.Function):
    """Scatter `scatter_dim` over the cp peers and gather `gather_dim`; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, tensor, state, scatter_dim: int, gather_dim: int):
        ctx.state, ctx.scatter_dim, ctx.gather_dim = state, scatter_dim, gather_dim
        return _exchange(tensor, state, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.state, ctx.gather_dim, ctx.scatter_dim), None, None, None


def _exchange(tensor: torch.Tensor, state, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    send = torch.stack(tensor.chunk(state.cp_size, dim=scatter_dim))
    return torch.cat(state.cp_all_to_all(send).unbind(0), dim=gather_dim)


def _document_starts(positions: torch.Tensor) -> torch.Tensor:
    """For each token of [b, s] position_ids: True where a document starts (the positions restart)."""
    return torch.diff(positions, dim=1, prepend=positions[:, :1] - 1) != 1


def _mask(positions: torch.Tensor, sliding_window: int | None, eager: bool, dtype: torch.dtype):
    """Causal, same-document and sliding-window mask over a stretch of the full sequence; None when the
    backend's own causal attention is all it takes (sdpa, one document, no window reached). Eager attention
    has no causal mode of its own: it always gets one, additive."""
    documents = _document_starts(positions).cumsum(dim=1)
    length = positions.shape[1]
    single = bool((documents[:, -1] == documents[:, 0]).all())
    if single and not eager and not (sliding_window and length > sliding_window):
        return None
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
    starts = [0, *_document_starts(positions[None])[0].nonzero().flatten().tolist()]
    spans = []
    for start, end in zip(starts, starts[1:] + [len(positions)]):
        if spans and end - spans[-1][0] <= window:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    return spans


def attend(attention, module, query, key, value, positions, sliding_window: int | None, eager: bool, window: int,
           **kwargs) -> torch.Tensor:
    """`attention` over the full sequence (query [b, h, S, d], key/value [b, kv, S, d], positions [b, S]),
    causal, within each document and the sliding window -> [b, S, h, d].

    Up to `window` tokens, one call with one mask. Longer sequences are cut between documents into spans
    of at most `window` tokens (or one longer document), each attended alone: tokens never attend across
    documents, so the result is the same, and a mask never exceeds `window` squared — over the whole
    sequence it would grow with S squared on every cp rank and outweigh the activations cp divides.
    """
    if positions.shape[1] <= window:
        return attention(module, query, key, value, _mask(positions, sliding_window, eager, query.dtype), **kwargs)[0]
    rows = []
    for row in range(query.shape[0]):
        pieces = [attention(module, *(t[row:row + 1, :, start:end] for t in (query, key, value)),
                            _mask(positions[row:row + 1, start:end], sliding_window, eager, query.dtype), **kwargs)[0]
                  for start, end in document_windows(positions[row], window)]
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows)


def backend_function(module, backend: str):
    """The attention function the model would call for `backend`: transformers' registered one, or for eager
    the model's own (each modeling file defines it; it is not in the registry)."""
    if backend == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[backend]


def ulysses_attention(module, query, key, value, attention_mask, *, state, backend: str, dropout: float = 0.0,
                      scaling: float | None = None, sliding_window: int | None = None, full_position_ids=None,
                      **kwargs):
    """query [b, H, s/cp, d], key/value [b, KV, s/cp, d], full_position_ids [b, S] (from SequenceShard, passed
    through the model's forward) -> output [b, s/cp, H, d]."""
    cp = state.cp_size
    kv_heads = key.shape[1]
    if kv_heads < cp:
        # Too few key/value heads to give each rank one: repeat them, so that rank r's query heads
        # (a contiguous 1/cp of them) meet the key/value head of their group.
        key, value = (t.repeat_interleave(cp // kv_heads, dim=1) for t in (key, value))
    # [b, heads, s/cp, d] -> [b, heads/cp, S, d]: scatter the heads, gather the sequence.
    query, key, value = (_AllToAll.apply(t, state, 1, 2) for t in (query, key, value))
    # Rank r holds query heads [r*H/cp, (r+1)*H/cp) and the key/value heads of exactly those groups. The
    # backend groups them as it does on one rank (sdpa without a mask attends grouped heads natively), so
    # backward keeps key/value at their own size, not repeated per query head.
    local = types.SimpleNamespace(num_key_value_groups=query.shape[1] // key.shape[1], is_causal=True,
                                  training=module.training, config=module.config)
    out = attend(backend_function(module, backend), local, query, key, value, full_position_ids, sliding_window,
                 backend == "eager", DOCUMENT_WINDOW, dropout=dropout, scaling=scaling, **kwargs)
    # out is [b, S, H/cp, d]: scatter the sequence back, gather the heads.
    return _AllToAll.apply(out, state, 1, 2), None


def register_attention(state, backend: str) -> str:
    """Install the Ulysses attention over this process's cp peers around `backend`; returns its name."""
    AttentionInterface.register(ATTENTION, partial(ulysses_attention, state=state, backend=backend))
    return ATTENTION
