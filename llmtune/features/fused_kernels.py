"""Liger's fused CUDA kernels (train.fused_kernels): its fused linear cross-entropy for the loss, and its RMSNorm,
SwiGLU and RoPE kernels in the model, Triton kernels that fuse what torch runs as several ops (and memory passes).
The CPU path and the plain torch ops stay the reference; tests/unit/test_fused_kernels.py compares the two on CUDA.

A feature acting at two points:
- check: refuses, before any process starts, a machine without CUDA, a missing liger-kernel package and a model
  type Liger has no kernels for, instead of a Triton error on every rank.
- build: patches the model with Liger's own patching API before activation checkpointing and sharding, so that
  the checkpointed, sharded layers run the kernels.
The loss is not patched here: it is llmtune's own, computed from the decoder's hidden states (loss.py), which
calls Liger's fused linear cross-entropy when LossOptions.fused says so.
"""

import importlib.util

import torch

from llmtune.features.base import Feature

FIX = "set train.fused_kernels: false"


class FusedKernels(Feature):
    name = "fused_kernels"
    on_reference = True

    @staticmethod
    def enabled(config) -> bool:
        return config.train.fused_kernels

    @staticmethod
    def check(config, model_config, world_size: int) -> list[str]:
        if not torch.cuda.is_available():
            return [f"train.fused_kernels: Liger's kernels run on CUDA only and this machine has none; {FIX}"]
        # find_spec, not an import: importing liger_kernel imports Triton.
        if importlib.util.find_spec("liger_kernel") is None:
            return [f"train.fused_kernels: liger-kernel is not installed; pip install liger-kernel, or {FIX}"]
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

        if model_config.model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
            return [f"train.fused_kernels: Liger has no kernels for model type {model_config.model_type}; {FIX}"]
        return []

    def build(self, hf_model, state) -> None:
        # The entry point the HF Trainer's use_liger_kernel calls (transformers.integrations.liger): it patches the
        # instance's modules and the modeling module's functions. Liger's own loss, a patched forward of the
        # *ForCausalLM class, stays off: the loss is computed by llmtune (loss.py), from the decoder alone.
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=hf_model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                        fused_linear_cross_entropy=False)
