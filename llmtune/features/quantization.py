"""model.quantize: nf4 (QLoRA): the frozen base's linear weights of the decoder layers held in 4-bit NF4
(model/quantize.py), built after peft's adapters so that what trains (the adapters, peft.modules_to_save) stays
in full precision.

What is the model's, not the feature's: the load quantizes each weight whole and keeps a rank's rows (model/state.py
copy_rows, model/pretrained.py), `whole` reads a quantized weight dequantized (the merged export, DoRA's norms),
FSDP2 keeps quantized weights out of a one-rank run (model/build.py). The checkpoints never hold them: they are
frozen, re-read and quantized again from the base on resume, which gives the same values.
"""

import importlib.util

import torch

from llmtune.features.adapters import Adapters, saved_module_names
from llmtune.features.base import Feature
from llmtune.model.build import decoder_layers, meta_model
from llmtune.model.quantize import GROUP, frozen_linears, quantize_weights, quantized_linears, splits, storage_dtype

FIX = "set model.quantize: none (LoRA on the unquantized base)"
# Why a quantized weight must hold whole groups, for the messages.
GROUPS = f"whole groups of {GROUP} values (NF4 scales blocks of 64 values and quantizes those scales in groups of 256)"


def planned_linears(config, model_config) -> dict[str, torch.nn.Linear]:
    """The frozen linear layers of a run of `config`, on a meta-device model without adapters: the decoder layers'
    linears but the modules peft trains in full (those of whole groups are quantized)."""
    hf_model = meta_model(model_config, config.model)
    hf_model.requires_grad_(False)
    for name in saved_module_names(hf_model, Adapters(config).modules_to_save()):
        hf_model.get_submodule(name).requires_grad_(True)
    return frozen_linears(hf_model, decoder_layers(hf_model))


def base_problems(config, model_config, world_size: int) -> list[str]:
    """Why the model's base cannot be held in NF4 on world_size ranks: it has no linear layer to quantize (GPT-2's
    Conv1D layers) or none of whole groups, or quantized weights that do not split over the ranks a copy is sharded
    over, named in one line with what works."""
    ranks = config.parallel.shard_size(world_size)
    frozen = {name: linear.weight.shape for name, linear in planned_linears(config, model_config).items()}
    if not frozen:
        return [f"model.quantize: nf4 quantizes the linear layers (torch.nn.Linear) of the decoder layers, and "
                f"{model_config.model_type}'s have none (GPT-2's, for one, are Conv1D); {FIX}"]
    planned = {name: shape for name, shape in frozen.items() if splits(shape, 1)}
    if not planned:
        name, shape = max(frozen.items(), key=lambda item: item[1].numel())
        return [f"model.quantize: nf4 holds a weight in {GROUPS}, and no linear weight of {model_config.model_type}'s "
                f"decoder layers has a multiple of {GROUP} values (the largest, {name}.weight, {list(shape)}, has "
                f"{shape.numel()}); {FIX}"]
    bad = {name: shape for name, shape in planned.items() if not splits(shape, ranks)}
    if not bad:
        return []
    name, shape = next(iter(bad.items()))
    more = f" and {len(bad) - 1} more weights" if len(bad) > 1 else ""
    works = [str(n) for n in range(1, ranks) if all(splits(weight, n) for weight in planned.values())]
    return [f"model.quantize: nf4 cannot hold {name}.weight (shape {list(shape)}){more} sharded over {ranks} rank(s): "
            f"each rank's equal share of a weight's rows (FSDP2's) must hold {GROUPS}; shard each copy of the model "
            f"over {' or '.join(works)} rank(s) (the world size / parallel.dp_replicate), or {FIX}"]


class QuantizedBase(Feature):
    """On when model.quantize is nf4 (peft.method qlora, or lora with model.quantize: nf4)."""

    name = "quantization"
    # A preference task's reference copy is the policy's starting point, whose base is quantized.
    on_reference = True

    @staticmethod
    def enabled(config) -> bool:
        return config.model.quantize != "none"

    @staticmethod
    def check(config, model_config, world_size: int) -> list[str]:
        if importlib.util.find_spec("torchao") is None:
            return ['model.quantize: nf4 needs torchao, which is not installed; pip install -e ".[qlora]" (or pip '
                    f"install torchao), or {FIX}"]
        if config.parallel.cpu_offload and config.parallel.shard_size(world_size) == 1 and torch.cuda.is_available():
            return ["parallel.cpu_offload: sharded over one rank, the 4-bit base of model.quantize stays outside FSDP2 "
                    "(which cannot gather NF4's tensors there, pytorch/pytorch#197999), so in the CPU's memory where "
                    "the GPU cannot compute with it; shard over 2 or more ranks, or set parallel.cpu_offload: false"]
        return base_problems(config, model_config, world_size)

    def build(self, hf_model, state) -> None:
        linears = quantized_linears(hf_model, decoder_layers(hf_model))
        quantize_weights(linears, storage_dtype(self.config.train.half_precision()))
