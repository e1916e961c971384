"""train.gradient_checkpointing: what each decoder layer keeps for its backward.

- none (false): every tensor autograd saves.
- full (true): the layer's input alone; the whole layer runs again in backward (transformers' gradient
  checkpointing, non-reentrant).
- selective: torchtitan's op-level policy. The layer is checkpointed as under full, but the outputs of the ops that
  cost FLOPs to recompute are kept: attention's, and every other matmul's (keeping them all would keep nearly what
  no checkpointing keeps); the cheap work (norms, rope, activation functions, casts, the other matmuls) runs again.
  Recomputing it gives the same values as the forward did, so the losses are those of no checkpointing.
"""

from collections import defaultdict
from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from llmtune.model.attention import document_sdpa

aten = torch.ops.aten
MATMULS = frozenset({aten.mm.default, aten.addmm.default, aten._grouped_mm.default})
# Attention's kernels, CPU and CUDA, and llmtune's document-span operator (compiled layers' attention): each output
# kept, never recomputed.
ATTENTION = frozenset({aten._scaled_dot_product_flash_attention.default,
                       aten._scaled_dot_product_flash_attention_for_cpu.default,
                       aten._scaled_dot_product_efficient_attention.default,
                       aten._scaled_dot_product_cudnn_attention.default, document_sdpa._opoverload})


def enable_checkpointing(hf_model, mode: str) -> None:
    """Each of hf_model's layers (transformers' GradientCheckpointingLayer: decoder layers, vision blocks)
    checkpointed in `mode`, full or selective."""
    hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs(mode))
    # transformers also makes every input embedding's output require grad, which reentrant checkpointing needs under
    # frozen embeddings and non-reentrant does not: kept, it would run a frozen vision tower under autograd, each
    # block's inputs held and the block recomputed in backward for no gradient.
    hf_model.disable_input_require_grads()


def checkpoint_kwargs(mode: str) -> dict:
    """torch.utils.checkpoint's keyword arguments for a mode that checkpoints (full, selective)."""
    kwargs = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = selective_contexts
    return kwargs


def selective_contexts():
    """The forward's and the recompute's contexts of one checkpointed call, with a matmul count of their own: the
    recompute must reach the same decision for each matmul as the forward did."""
    return create_selective_checkpoint_contexts(partial(_policy, defaultdict(int)))


def _policy(counts: dict, ctx, func, *args, **kwargs) -> CheckpointPolicy:
    keep = kept(counts, func, "recompute" if ctx.is_recompute else "forward")
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def kept(counts: dict, func, phase: str = "forward") -> bool:
    """Whether selective checkpointing keeps the output of `func`, an op a checkpointed layer runs in `phase`
    (forward, recompute), `counts` the layer call's matmuls of each phase so far (updated): attention's, and the
    first, third, ... matmul's. Also what `llmtune plan` counts of each layer (run/plan.py)."""
    if func in MATMULS:
        counts[phase] += 1
        return counts[phase] % 2 == 1
    return func in ATTENTION
