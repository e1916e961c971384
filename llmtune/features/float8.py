"""train.fp8: float8 training through torchao. The decoder layers' linear layers that are large enough to gain
multiply in float8 with rowwise scales (torchao's `rowwise` recipe: each row of the input and each column of the
weight scaled by its own amax, the scales rounded to powers of 2), forward and backward; the gradients, weights,
optimizer, checkpoints and exports are untouched (torchao's Float8Linear keeps the weight and bias parameters of the
nn.Linear it replaces, under the same names).

Which layers: torchao's own filter for the recipe (both dimensions multiples of 16, as float8 kernels need, and large
enough that the casts cost less than the faster matmul saves: on H100, an out dimension above 2048 and an in dimension
above 1024, not both small), on the decoder layers alone: the lm_head's loss is llmtune's chunked one (model/loss.py)
and stays in bf16, as torchtitan keeps its output layer. The weights are gathered by FSDP2 in bf16 and cast per
matmul: torchao's float8 all-gather serves tensorwise scales only.

A feature acting at two points:
- check: refuses, before any process starts, a machine without a GPU with float8 tensor cores (compute capability
  8.9, Ada and Hopper, or later), a missing torchao, adapters (float8 training serves the full fine-tune's matmuls;
  peft's frozen base would need tests of its own), and a model with no linear layer the filter keeps.
- build: swaps the layers before activation checkpointing and sharding.
"""

import importlib.util

import torch
from torch import nn

from llmtune.features.base import Feature
from llmtune.model.build import decoder_layers, meta_model

FIX = "set train.fp8: false"
RECIPE = "rowwise"
CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0) and later


def float8_linears(hf_model) -> dict[str, nn.Linear]:
    """The linear layers of the decoder layers that float8 training computes, by name in `hf_model`: those torchao's
    filter for the recipe keeps."""
    from torchao.float8 import _auto_filter_for_recipe

    keep = _auto_filter_for_recipe(RECIPE, filter_fqns=[])
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


class Float8Training(Feature):
    name = "fp8"
    on_reference = True  # a preference task's reference computes as the policy does

    @staticmethod
    def enabled(config) -> bool:
        return config.train.fp8

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
        if not float8_linears(meta_model(model_config, config.model)):
            return [f"train.fp8: none of {model_config.model_type}'s linear layers is large enough to gain from "
                    f"float8 (torchao's {RECIPE} filter: out dimension above 2048 and in dimension above 1024, "
                    f"multiples of 16); {FIX}"]
        return []

    def build(self, hf_model, state) -> None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        chosen = set(float8_linears(hf_model))
        convert_to_float8_training(hf_model, config=Float8LinearConfig.from_recipe_name(RECIPE),
                                   module_filter_fn=lambda module, name: name in chosen)
