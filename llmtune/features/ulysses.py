"""Ulysses context parallelism on stock HF models: each of cp ranks holds 1/cp of a sequence's tokens.

A feature (features/base.py) acting at three points:
- check: the model's heads can be spread over the cp ranks; no attention sinks.
- build: installs, through transformers' attention interface, a function that wraps the backend the
  model would use: all-to-all from [sequence shard, all heads] to [full sequence, heads/cp], the
  backend's attention over the full sequence, all-to-all back. sdpa and eager attend document span by
  span with the masks built here (attention.attend); a varlen backend (flash attention) is given the full
  sequence's document boundaries (cu_seq_lens, attention.varlen_kwargs) and no mask.
- transform: `SequenceShard` cuts every micro-batch: labels were shifted before (each slice keeps the
  label of its last token), the sequence is padded to a multiple of cp with label -100, and every
  rank keeps a contiguous slice of input_ids, labels and GLOBAL position_ids (RoPE sees true
  positions; packed documents keep their restarts), plus the whole sequence's document positions
  (attention.document_positions), which the model passes through to every layer's attention.

The mesh (dp_shard x cp, cp peers reading the same batch) is the layout's, in ParallelState; counting
each labelled token once over dp x cp is the trainer's, whatever the feature.

Because the function's name is not in transformers' mask registry, the model hands it no mask;
the documents are read from the full sequence's document positions instead.
"""

from functools import partial

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from llmtune.features.base import Feature
from llmtune.model import attention
from llmtune.model.attention import attend, backend_function, document_positions, is_varlen, varlen_kwargs
from llmtune.model.loss import IGNORE_INDEX, TOKEN_VALUES
from llmtune.model.multimodal import is_multimodal

ATTENTION = "llmtune_ulysses"


def layout_problems(model_config, cp: int, tp: int = 1) -> list[str]:
    """What stops this model (its transformers config, whatever names its config.json uses) from running with
    cp ranks per sequence; with tp ranks besides, the heads each tp rank holds are spread over the cp ranks."""
    text = model_config.get_text_config()
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads and tp > 1 and not heads % tp and not kv_heads % tp:
        heads, kv_heads = heads // tp, kv_heads // tp
    problems = []
    if heads is None or heads % cp:
        problems.append(f"parallel.cp_size: {cp} does not divide the model's {heads} attention heads"
                        f"{' per tp rank' if tp > 1 else ''}; choose a cp_size that divides it")
    elif kv_heads % cp and cp % kv_heads:
        problems.append(f"parallel.cp_size: the model's {kv_heads} key/value heads are neither a multiple nor a "
                        f"divisor of cp_size {cp}, so they cannot be spread over the cp ranks")
    if getattr(text, "attention_sinks", None) or text.model_type == "gpt_oss":
        problems.append("parallel.cp_size: attention sinks are not supported with context parallelism")
    if is_multimodal(model_config):
        # Slicing a row before its images' embeddings are in place would cut an image's tokens from the patches
        # the vision tower encodes for them.
        problems.append(f"parallel.cp_size: {model_config.model_type} is a vision-language model, and context "
                        "parallelism does not yet slice rows that hold images; set parallel.cp_size 1")
    return problems


class ContextParallel(Feature):
    name = "context_parallel"
    on_reference = True

    @staticmethod
    def enabled(config) -> bool:
        return config.parallel.cp_size > 1

    @staticmethod
    def check(config, model_config, world_size: int) -> list[str]:
        problems = layout_problems(model_config, config.parallel.cp_size, config.parallel.tp_size)
        if config.model.attn_implementation == "flex_attention":
            # Its block mask is built by transformers for the rows the model sees, here 1/cp of each.
            problems.append("parallel.cp_size: flex_attention does not run with context parallelism; use sdpa or "
                            "flash_attention_2")
        return problems

    def build(self, hf_model, state) -> None:
        backend = hf_model.config._attn_implementation
        self.varlen = is_varlen(backend)
        self.keeps_shared_prefixes = not self.varlen  # sdpa and eager attend the spans of attention.attend
        hf_model.set_attn_implementation(register_attention(state, backend))
        self.shard = SequenceShard(state.cp_size, state.cp_rank)

    def transform(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        inputs = self.shard(inputs)
        positions = inputs["document_positions"]
        # Read here, on the host copy (Trainer.prepare): what the attention needs to know of the documents.
        inputs.update(varlen_kwargs(positions) if self.varlen
                      else {"document_spans": attention.document_spans(positions)})
        return inputs


class SequenceShard:
    """This rank's contiguous slice of every sequence of a micro-batch, and the whole sequence's position_ids
    for the attention (which sees the full sequence and masks it by document)."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank

    def __call__(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        inputs = padded_rows(inputs, self.size)
        documents = document_positions(inputs)
        padded = inputs["input_ids"].shape[1]
        part = slice(self.rank * padded // self.size, (self.rank + 1) * padded // self.size)
        sliced = {key: inputs[key][:, part].contiguous() for key in ("input_ids", "shift_labels", "position_ids")}
        sliced["document_positions"] = documents.contiguous()
        for key in (key for key in ("sequence_ids", *TOKEN_VALUES) if key in inputs):
            sliced[key] = inputs[key][:, part].contiguous()
        return sliced


# Any valid token id pads a row: the pads come after every real token, which causal attention never lets look ahead,
# and they carry no label.
PAD_ID = 0


def padded_rows(inputs: dict[str, torch.Tensor], multiple: int) -> dict[str, torch.Tensor]:
    """A micro-batch's rows padded to a multiple of `multiple` tokens, so that they split evenly over that many ranks
    (cp peers, or tp ranks under sequence parallelism): the pads carry no label, go on counting the last
    document's positions (they join it, after all of its tokens), belong to no sequence and are masked out where the
    rows have an attention mask. The inputs as they are where nothing is padded, and with position_ids."""
    input_ids = inputs["input_ids"]
    batch, length = input_ids.shape
    positions = inputs.get("position_ids")
    if positions is None:
        positions = torch.arange(length, device=input_ids.device).expand(batch, length)
    extra = -(-length // multiple) * multiple - length
    padded = {**inputs, "position_ids": positions}
    if not extra:
        return padded
    padded.update(input_ids=F.pad(input_ids, (0, extra), value=PAD_ID),
                  shift_labels=F.pad(inputs["shift_labels"], (0, extra), value=IGNORE_INDEX),
                  position_ids=torch.cat([positions, positions[:, -1:] + torch.arange(1, extra + 1,
                                                                                     device=positions.device)], 1))
    if "attention_mask" in inputs:
        padded["attention_mask"] = F.pad(inputs["attention_mask"], (0, extra))
    if "sequence_ids" in inputs:  # a preference task's: which sequence each token belongs to (-1: padding)
        padded["sequence_ids"] = F.pad(inputs["sequence_ids"], (0, extra), value=-1)
    for key in (key for key in TOKEN_VALUES if key in inputs):  # values in line with the labels
        padded[key] = F.pad(inputs[key], (0, extra))
    return padded


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


class _BackendConfig:
    """The config a varlen backend reads its name from (a plain class, as attention.AttentionHeads)."""

    def __init__(self, backend: str):
        self._attn_implementation = backend


def ulysses_attention(module, query, key, value, attention_mask, *, state, backend: str, dropout: float = 0.0,
                      scaling: float | None = None, sliding_window: int | None = None, document_positions=None,
                      document_spans=None, **kwargs):
    """query [b, H, s/cp, d], key/value [b, KV, s/cp, d], document_positions [b, S] (from SequenceShard, passed
    through the model's forward) -> output [b, s/cp, H, d]. A varlen backend finds the documents in kwargs
    instead (cu_seq_lens of the full sequence, from ContextParallel.transform)."""
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
    # A varlen backend reads its name from the config, which names this wrapper now: it is given its own.
    local = attention.AttentionHeads(query.shape[1] // key.shape[1], module.training,
                                     _BackendConfig(backend) if is_varlen(backend) else module.config)
    function = backend_function(module, backend)
    if is_varlen(backend):
        out = function(local, query, key, value, None, dropout=dropout, scaling=scaling,
                       sliding_window=sliding_window, **kwargs)[0]
    else:
        out = attend(function, local, query, key, value, document_positions, sliding_window, backend == "eager",
                     attention.DOCUMENT_WINDOW, document_spans, dropout=dropout, scaling=scaling, **kwargs)
    # out is [b, S, H/cp, d]: scatter the sequence back, gather the heads.
    return _AllToAll.apply(out, state, 1, 2), None


def register_attention(state, backend: str) -> str:
    """Install the Ulysses attention over this process's cp peers around `backend`; returns its name."""
    AttentionInterface.register(ATTENTION, partial(ulysses_attention, state=state, backend=backend))
    return ATTENTION
