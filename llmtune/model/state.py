"""The model's tensors as checkpoints and HF folders hold them: the value of a parameter that FSDP2 shards on
dim 0, the rows of it a rank holds, and the persistent buffers that are saved beside the parameters. A quantized
parameter (model/quantize.py) reads as the values it stands for and is set from full-precision ones."""

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from llmtune.model.quantize import dequantized, held, is_quantized, set_rows


def whole(param: torch.Tensor) -> torch.Tensor:
    """The full value of a parameter, gathered from every rank when it is sharded (every rank must call); a
    quantized one dequantized (each rank its rows, which are those of the whole tensor's dequantization)."""
    if not is_quantized(param):
        return unwrapped(param.full_tensor() if isinstance(param, DTensor) else param.detach())
    rows = dequantized(held(param))
    if not isinstance(param, DTensor):
        return rows
    return DTensor.from_local(rows, param.device_mesh, param.placements, run_check=False).full_tensor()


def unwrapped(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside a subclass that wraps one to change how it computes (torchao's float8 weights,
    WeightWithDynamicFloat8CastTensor, which gathering and copying keep): what a file saves."""
    while type(tensor) is not torch.Tensor and hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        tensor = getattr(tensor, names[0])
    return tensor


def copy_rows(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set a parameter, sharded or not, from its full value: each rank copies the block its shard holds (of a
    quantized one: the rows of the whole value quantized)."""
    if is_quantized(param):
        set_rows(held(param), value, shard_start(param))
        return
    local_rows(param).copy_(value[local_block(param)])


def laid_out_like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The full `value` laid out as `param` (evenly sharded, as quantized parameters are): a DTensor of this rank's
    block, sharded as `param` is, when it is one."""
    if not isinstance(param, DTensor):
        return value
    return DTensor.from_local(value[local_block(param)], param.device_mesh, param.placements, run_check=False)


def local_rows(param: torch.Tensor) -> torch.Tensor:
    """The rows of a parameter this rank holds (all of them when it is not sharded)."""
    return param.to_local() if isinstance(param, DTensor) else param.data


def shard_start(param: torch.Tensor) -> int:
    """The first row of dim 0 held by this rank (its local shard holds the rows that follow), where torch lays it:
    FSDP2 shards dim 0 as torch.chunk does, over the mesh's shard dimension (under HSDP the other one replicates);
    expert parallelism's experts are chunked over ep first, then each rank's share over FSDP2's ranks; a
    tensor-parallel weight is split over the tp ranks first (a colwise one's rows, a rowwise one's columns)."""
    return local_block(param)[0].start if param.dim() else 0


def local_block(param: torch.Tensor) -> tuple[slice, ...]:
    """The slices of the full value that this rank's shard holds, one per dim (everything when it is not
    sharded)."""
    if not isinstance(param, DTensor):
        return tuple(slice(0, size) for size in param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, shape))


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers that are part of the state dict, hence of checkpoints (DeepSeek-V3's router bias): loaded and
    exported like parameters. Most buffers (RoPE frequencies) are not, and are computed by the model."""
    buffers = {}
    for name, buffer in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if leaf not in model.get_submodule(owner)._non_persistent_buffers_set:
            buffers[name] = buffer
    return buffers


def saved_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What checkpoints of the model hold: its parameters and persistent buffers, in state-dict order, a parameter
    tied to another (lm_head to the embeddings) once, under its first name."""
    params = dict(model.named_parameters())
    buffers = persistent_buffers(model)
    return {name: tensor for name, tensor in model.state_dict(keep_vars=True).items()
            if name in params or name in buffers}
