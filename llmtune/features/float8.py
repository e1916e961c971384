"""train.fp8: float8 training through torchao. The decoder layers' linear layers that are large enough to gain
multiply in float8, forward and backward, with one of torchao's two scalings; the gradients, weights, optimizer,
checkpoints and exports are untouched (torchao's Float8Linear keeps the weight and bias parameters of the nn.Linear it
replaces, under the same names).

- tensorwise (train.fp8: true; torchao's default, torchtitan's): one scale per tensor. FSDP2 all-gathers the weights
  in float8, cast from each rank's fp32 shard with a scale from the whole weight's amax (torchao's
  enable_fsdp_float8_all_gather: half the bytes of a bf16 all-gather, and no cast per matmul); the amaxes of all the
  weights are all-reduced once per step, before its first forward (torchao's
  precompute_float8_dynamic_scale_for_fsdp), instead of once per weight and all-gather. Set on one process too, so
  that a run computes the same numbers on one process as on several.
- rowwise: a scale per row of the input and per column of the weight, rounded to powers of 2; more accurate, slower
  (more scales to compute); the weights are gathered in bf16 and cast per matmul (torchao's float8 all-gather serves
  tensorwise scales only).

Which layers: torchao's own filter for the scaling (both dimensions multiples of 16, as float8 kernels need, and
large enough that the casts cost less than the faster matmul saves, measured by torchao on H100), on the decoder
layers alone: the lm_head's loss is llmtune's chunked one (model/loss.py) and stays in bf16, as torchtitan keeps its
output layer. Only under train.compile (config.py refuses it otherwise), which fuses the casts and scalings.

The activations' scales come from each rank's own micro-batch (dynamic scaling, as in every float8 trainer), so a
float8 run's numbers depend on the split over ranks and micro-batches within float8's rounding, unlike bf16's.

A feature acting at three points:
- check: refuses, before any process starts, a machine without a GPU with float8 tensor cores (compute capability
  8.9, Ada and Hopper, or later), a missing torchao, adapters (float8 training serves the full fine-tune's matmuls;
  peft's frozen base would need tests of its own), and a model with no linear layer the filter keeps.
- build: swaps the layers before activation checkpointing and sharding.
- around_step: tensorwise, the weights' scales computed before the step's forwards, and dropped after its backwards
  (the optimizer then changes the weights): an evaluation, a moving average's swap or a generation between steps
  computes them as it gathers.
"""

import contextlib
import importlib.util

import torch
from torch import nn

from llmtune.features.base import Feature
from llmtune.model.build import decoder_layers, meta_model

FIX = "set train.fp8: false"
CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0) and later
# torchao's size filters ([out, in] of a weight; float8_linear_utils._auto_filter_for_*), in words for the refusal
# of a model they leave nothing of.
FILTERS = {"tensorwise": "an in dimension above 4096 or an out dimension above 1024",
           "rowwise": "an out dimension above 2048 and an in dimension above 1024, not an out dimension of 4096 or "
                      "less with an in dimension of 2048 or less"}


def float8_linears(hf_model, scaling: str) -> dict[str, nn.Linear]:
    """The linear layers of the decoder layers that float8 training computes, by name in `hf_model`: those torchao's
    filter for the scaling (config.FLOAT8_SCALINGS) keeps."""
    from torchao.float8 import _auto_filter_for_recipe

    keep = _auto_filter_for_recipe(scaling, filter_fqns=[])
    inside = {id(module) for layer in decoder_layers(hf_model) for module in layer.modules()}
    return {name: module for name, module in hf_model.named_modules()
            if id(module) in inside and isinstance(module, nn.Linear) and keep(module, name)}


def float8_layer_count(hf_model) -> int:
    """The linear layers of a built model that compute in float8 (torchao's Float8Linear), for the start banner."""
    return sum(type(module).__name__ == "Float8Linear" for module in hf_model.modules())


def device_problem() -> str | None:
    """Why this machine cannot train in float8, or None: the launching machine's first GPU stands for the job's."""
    if not torch.cuda.is_available():
        return f"train.fp8: float8 training needs a GPU with float8 tensor cores and this machine has none; {FIX}"
    capability = torch.cuda.get_device_capability()
    if capability < CAPABILITY:
        name = torch.cuda.get_device_name()
        return (f"train.fp8: {name} (compute capability {capability[0]}.{capability[1]}) has no float8 tensor cores, "
                f"which need 8.9 or later (H100, H200, L4, L40S, ...); {FIX}")
    return None


def float8_weights(model) -> list:
    """The local shards of the float8 layers' weights that FSDP2 all-gathers in float8 (tensorwise scaling)."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return [module.weight._local_tensor for module in model.modules()
            if type(module).__name__ == "Float8Linear" and isinstance(module.weight, DTensor)
            and isinstance(module.weight._local_tensor, WeightWithDynamicFloat8CastTensor)]


class Float8Training(Feature):
    name = "fp8"
    on_reference = True  # a preference task's reference computes as the policy does

    @staticmethod
    def enabled(config) -> bool:
        return config.train.float8_scaling() is not None

    @staticmethod
    def check(config, model_config, world_size: int) -> list[str]:
        problem = device_problem()
        if problem:
            return [problem]
        if importlib.util.find_spec("torchao") is None:
            return [f'train.fp8: needs torchao, which is not installed; pip install -e ".[fp8]" (or pip install '
                    f"torchao), or {FIX}"]
        if config.peft.method != "none":
            return [f"train.fp8: float8 training serves full fine-tuning, not peft.method {config.peft.method}; "
                    f"set peft.method: none, or {FIX}"]
        scaling = config.train.float8_scaling()
        if not float8_linears(meta_model(model_config, config.model), scaling):
            return [f"train.fp8: none of {model_config.model_type}'s linear layers is large enough to gain from "
                    f"float8 (torchao's {scaling} filter: dimensions multiples of 16, and {FILTERS[scaling]}); {FIX}"]
        return []

    def build(self, hf_model, state) -> None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        scaling = self.config.train.float8_scaling()
        chosen = set(float8_linears(hf_model, scaling))
        config = (Float8LinearConfig(enable_fsdp_float8_all_gather=True) if scaling == "tensorwise"
                  else Float8LinearConfig.from_recipe_name(scaling))
        convert_to_float8_training(hf_model, config=config, module_filter_fn=lambda module, name: name in chosen)

    @contextlib.contextmanager
    def around_step(self, model):
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        # The same numbers as the scales computed at each all-gather (the amax of the whole weight, clamped, in
        # fp64, as torchao's amax_to_scale), with one all-reduce for every weight.
        precompute_float8_dynamic_scale_for_fsdp(model)
        try:
            yield
        finally:
            for weight in float8_weights(model):
                weight._precomputed_scale = None
