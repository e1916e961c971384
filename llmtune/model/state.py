"""The model's tensors as checkpoints and HF folders hold them: the value of a parameter that FSDP2 shards on
dim 0, the rows of it a rank holds, and the persistent buffers that are saved beside the parameters."""

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def whole(param: torch.Tensor) -> torch.Tensor:
    """The full value of a parameter, gathered from every rank when it is sharded (every rank must call)."""
    return param.full_tensor() if isinstance(param, DTensor) else param.detach()


def copy_rows(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set a parameter, sharded or not, from its full value: each rank copies the rows its shard holds."""
    local = local_rows(param)
    start = shard_start(param)
    local.copy_(value[start:start + len(local)])


def local_rows(param: torch.Tensor) -> torch.Tensor:
    """The rows of a parameter this rank holds (all of them when it is not sharded)."""
    return param.to_local() if isinstance(param, DTensor) else param.data


def shard_start(param: torch.Tensor) -> int:
    """The first row of dim 0 held by this rank (its local shard holds the rows that follow): FSDP2 shards dim 0
    as torch.chunk does, over the mesh's shard dimension (under HSDP the other one replicates)."""
    if not isinstance(param, DTensor):
        return 0
    mesh, rows = param.device_mesh, param.shape[0]
    dim = next((d for d, placement in enumerate(param.placements) if placement.is_shard(0)), None)
    if dim is None:
        return 0
    per_rank = -(-rows // mesh.size(dim))
    return min(mesh.get_local_rank(dim) * per_rank, rows)


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
