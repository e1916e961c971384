"""The reference model of a preference task (dpo.reference): what gives each sequence of a micro-batch its summed
log-probabilities under the weights training started from.

- model: a second model built as the policy is (the same features that shape its computation: the attention of
  packed documents, context parallelism, fused kernels), every weight frozen (so stored in the compute dtype under
  bf16 or fp16, as frozen weights are), sharded by FSDP2 over the same ranks, in eval mode (no dropout), never given
  to the optimizer. FSDP2 keeps the root's parameters (the embeddings and the lm_head, the largest with a big
  vocabulary), and every layer's under parallel.reshard_after_forward false, gathered after a forward, expecting a
  backward: the reference has none, so it reshards them at once.
- adapter_off: the policy itself with its peft adapters passing their inputs through (features/adapters.py), under
  no_grad: no second copy at all.
- precomputed: the values computed once before training (tasks/precompute.py), read from the micro-batch.

Every reference returns the sums of whole sequences, the same on the cp peers (each holds a slice of the tokens).
"""

from dataclasses import replace

import torch

from llmtune.features.adapters import Adapters
from llmtune.features.base import Feature
from llmtune.model.build import build_model, load_model_config, reshard


def sequence_count(batch) -> int:
    """The sequences of a micro-batch (data/collate.py numbers them; chosen and rejected of a pair in turn)."""
    return len(batch.sequences["length"])


class FrozenReference(Feature):
    """The first feature of the reference copy: every weight frozen before the build stores and shards them."""

    name = "reference"

    @staticmethod
    def enabled(config) -> bool:
        return False  # never one of the policy's features: tasks/reference.py builds the copy with it

    def build(self, hf_model, state) -> None:
        hf_model.requires_grad_(False)


class ModelReference:
    def __init__(self, module, state):
        self.module, self.state = module, state
        module.eval()

    def logps(self, inputs: dict, batch) -> torch.Tensor:
        with torch.no_grad():
            local, _, _ = self.module.sequence_logps(**inputs, sequences=sequence_count(batch))
        reshard(self.module)
        return self.state.cp_sum(local)

    def token_logps(self, inputs: dict, temperature: float) -> torch.Tensor:
        """Each labelled token's log-probability at `temperature`, of this rank's slice (grpo's KL term)."""
        with torch.no_grad():
            logps, _, _ = self.module.token_logps(**inputs, temperature=temperature)
        reshard(self.module)
        return logps


class AdapterOffReference:
    def __init__(self, model, state):
        self.model, self.state = model, state

    def logps(self, inputs: dict, batch) -> torch.Tensor:
        with torch.no_grad(), Adapters.disabled(self.model.hf_model):
            local, _, _ = self.model.sequence_logps(**inputs, sequences=sequence_count(batch))
        return self.state.cp_sum(local)

    def token_logps(self, inputs: dict, temperature: float) -> torch.Tensor:
        with torch.no_grad(), Adapters.disabled(self.model.hf_model):
            logps, _, _ = self.model.token_logps(**inputs, temperature=temperature)
        return logps


class PrecomputedReference:
    def logps(self, inputs: dict, batch) -> torch.Tensor:
        return batch.sequences["ref_logps"]


def reference_source(config, local, model_config):
    """(model section, transformers config) of the reference's weights: the task's ref_model (dpo.ref_model, ...),
    else the policy's own. `local`: the recipe with its Hub ids fetched (ref_model's too)."""
    ref_model = local.reference_section().ref_model
    if not ref_model:
        return local.model, model_config
    model_cfg = replace(local.model, name_or_path=ref_model, config=None, init_from=None)
    return model_cfg, load_model_config(model_cfg)


def reference_model(config, local, model_config, features, state) -> ModelReference:
    """A frozen copy of the reference's weights, built and sharded as the policy is."""
    model_cfg, model_config = reference_source(config, local, model_config)
    # No backward: nothing to recompute.
    train_cfg = replace(config.train, gradient_checkpointing=False)
    module = build_model(model_config, model_cfg, train_cfg, state, features.for_reference(FrozenReference(config)))
    return ModelReference(module, state)


def build_reference(config, local, model_config, model, features, state):
    """The reference the task's section names for training (dpo.reference, ...; precomputed: what reads the values
    tasks/precompute.py added to the rows)."""
    kind = config.reference_section().reference
    if kind == "adapter_off":
        return AdapterOffReference(model, state)
    if kind == "precomputed":
        return PrecomputedReference()
    return reference_model(config, local, model_config, features, state)
