"""model.quantize: nf4 (QLoRA): the frozen linear weights of the decoder layers held in 4-bit NormalFloat, as
torchao's NF4Tensor, which FSDP2 shards and all-gathers in its 4-bit form (its fsdp_pre/post_all_gather hooks
gather the packed values and their scales, never a bf16 copy); each linear layer dequantizes its weight when it
runs, in the dtype of its input.

NF4 scales each block of BLOCK values by its largest magnitude, and stores those scales in 8 bits again, each
group of SCALER_BLOCK scales against its own factor and the mean of every scale of the tensor (double
quantization). That mean makes a rank's own rows, quantized alone, come out other than the same rows of the whole
tensor quantized: so every weight is quantized whole, and each rank keeps its rows of the result (set_rows). The
4-bit values a layer gathers are then those of the whole tensor quantized, on any number of ranks; the rows of a
rank must hold whole groups of GROUP values, which `splits` checks before a run. A weight that is no whole number of
groups (a tiny model's k_proj of 64 x 128) torchao cannot quantize at these block sizes on any number of ranks: it
stays frozen in the compute dtype.

llmtune imports torchao's NF4 module when a run quantizes, on first use (transformers imports torchao itself wherever it
is installed).
"""

import importlib
import sys

import torch
from torch import nn
from torch.distributed.tensor import DTensor

# QLoRA's block sizes (the paper's, bitsandbytes' and torchtune's): a scale per 64 values, a factor per 256 scales.
BLOCK = 64
SCALER_BLOCK = 256
GROUP = BLOCK * SCALER_BLOCK
NF4_MODULE = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"
# The tensors of an NF4Tensor that hold its rows (split with them by FSDP2), by the values each element covers.
ROW_TENSORS = {"quantized_data": 2, "quantized_scalers": BLOCK, "quantization_factor": GROUP}


def nf4_module():
    """torchao's NF4 module (NF4Tensor, to_nf4)."""
    return importlib.import_module(NF4_MODULE)


def held(param: torch.Tensor) -> torch.Tensor:
    """The tensor that holds a parameter's values on this rank: the local tensor of a sharded one (the one FSDP2
    gathers from), else the parameter itself. Not to_local() or .data, which wrap an NF4 tensor's data in a new
    NF4Tensor: what set_rows sets on that one would be lost."""
    return param._local_tensor if isinstance(param, DTensor) else param


def is_quantized(tensor: torch.Tensor) -> bool:
    """Whether a parameter (sharded or not) holds NF4 values. No NF4 tensor exists before torchao's NF4 module is
    imported, so a run without quantization never imports it to ask."""
    module = sys.modules.get(NF4_MODULE)
    return module is not None and isinstance(held(tensor), module.NF4Tensor)


def storage_dtype(half: str | None) -> torch.dtype:
    """The dtype NF4 dequantizes to and keeps its scales' factors in: bf16 under bf16, else fp32. Not fp16 under
    fp16: a group's factor is 256 / (2 x the largest distance of its scales from their mean), beyond fp16's range
    (65504) once that distance is below 0.002."""
    return torch.bfloat16 if half == "bf16" else torch.float32


def frozen_linears(hf_model, layers: list[nn.Module]) -> dict[str, nn.Linear]:
    """The linear layers of the decoder layers that stay frozen (not an adapter, not a module trained in full), by
    name."""
    inside = {id(module) for layer in layers for module in layer.modules()}
    return {name: module for name, module in hf_model.named_modules()
            if type(module) is nn.Linear and id(module) in inside and not module.weight.requires_grad}


def quantized_linears(hf_model, layers: list[nn.Module]) -> dict[str, nn.Linear]:
    """The linear layers whose weights are quantized, by name: the frozen ones of whole groups. Embeddings, norms,
    the lm_head and biases keep the compute dtype."""
    return {name: module for name, module in frozen_linears(hf_model, layers).items() if splits(module.weight.shape, 1)}


def splits(shape: torch.Size, ranks: int) -> bool:
    """Whether a weight of `shape` can be held in NF4 sharded over `ranks` (1: whole): FSDP2 splits dim 0 in equal
    shares (NF4 has no padding), each of which must hold whole groups."""
    return shape[0] % ranks == 0 and shape.numel() % (GROUP * ranks) == 0


def quantize_weights(linears: dict[str, nn.Linear], dtype: torch.dtype) -> None:
    """Each layer's weight replaced by its NF4 form (on the meta device, the shapes and metadata alone: the values
    come with the load, set_rows), frozen."""
    to_nf4 = nf4_module().to_nf4
    for linear in linears.values():
        weight = linear.weight.detach().to(dtype)
        linear.weight = nn.Parameter(to_nf4(weight, BLOCK, SCALER_BLOCK), requires_grad=False)


def set_rows(local: torch.Tensor, value: torch.Tensor, start: int) -> None:
    """An NF4 shard (`local`, the rows from `start` on) set from the weight's full value: the rows of the whole
    value quantized. The mean and the lookup table of NF4 are set by reference: torchao's empty_like (to_empty)
    leaves them on the meta device, where a copy into them would do nothing."""
    whole = nf4_module().to_nf4(value.to(device=local.device, dtype=local.dtype), BLOCK, SCALER_BLOCK)
    per_row = value[0].numel()
    for name, covers in ROW_TENSORS.items():
        first, count = start * per_row // covers, len(local) * per_row // covers
        getattr(local, name).copy_(getattr(whole, name)[first:first + count])
    local.scaler_mean, local.nf4 = whole.scaler_mean, whole.nf4


def dequantized(local: torch.Tensor) -> torch.Tensor:
    """The values an NF4 tensor (or shard) stands for, in its dtype."""
    return local.get_original_weight()


def stored_bytes(local: torch.Tensor) -> int:
    """What an NF4 tensor (or shard) holds in memory: its packed values and their scales."""
    return sum(getattr(local, name).nbytes for name in ROW_TENSORS)


def nf4_bytes(numel: int, dtype: torch.dtype) -> int:
    """stored_bytes of an NF4 tensor of `numel` values: half a byte each, a byte per BLOCK, a factor per GROUP."""
    return numel // 2 + numel // BLOCK + numel // GROUP * dtype.itemsize


def dequantized_bytes(numel: int, dtype: torch.dtype) -> int:
    """The transient memory of dequantizing an NF4 weight of `numel` values to `dtype` (a linear layer's forward and
    backward): torchao's get_original_weight holds the 4-bit indices as int64 (8 bytes a value) beside three
    tensors of the weight's size in `dtype` at its fullest (the looked-up values, their scaled products, the result):
    14 bytes a value in bf16, 20 in fp32, as a count of the tensors alive during it gives for a 1024 x 4096 weight."""
    return numel * (8 + 3 * dtype.itemsize)
