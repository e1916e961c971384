"""ParallelState: the process group, the device mesh and this rank's place in it.

Created once per process and passed down; nothing else reads the distributed environment.
"""

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from llmtune.config import ParallelConfig
from llmtune.errors import UserError
from llmtune.run.launch import launched_by_torchrun

LONG_WAIT = timedelta(hours=24)


@dataclass
class ParallelState:
    """World = dp_replicate x dp_shard x cp x tp, tp innermost. tp peers (consecutive ranks: a node's GPUs) split each
    layer's weights and compute the same tokens together; cp peers (the next dimension out) hold slices of the same
    sequences; the data sampler sees the dp_replicate x dp_shard ranks; FSDP shards over dp_shard x cp within each
    replica group (cp ranks hold different tokens and so different gradients, which must be reduced too) and, with
    dp_replicate > 1 (HSDP), all-reduces the gradients across the groups. One root mesh holds every dimension:
    FSDP2 shards a tensor-parallel DTensor over its data-parallel ranks only when both meshes come from one root."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh  # ("dp_replicate", "dp_shard", "cp", "tp")
    fsdp_mesh: DeviceMesh  # ("dp_shard_cp",) of every tp rank's peers, or ("dp_replicate", "dp_shard_cp") under HSDP
    # For the waits on one rank's long work (a Hub download, tokenizing a corpus): a gloo group whose timeout outlasts
    # any of them, since the training group's (parallel.timeout_minutes) is fixed when it is made. A rank that fails
    # shares its error at once and one that dies closes its connections, so this timeout only ends a stalled wait.
    wait_group: object
    parallel: ParallelConfig  # the recipe's parallel section: the layout, offload and resharding choices
    # Under parallel.expert_parallel n: ("dp_replicate", "efsdp", "ep") over the same ranks, ep the n consecutive
    # ranks an experts module is split over, efsdp the shard ranks left to shard each expert; None without.
    expert_mesh: DeviceMesh | None = None
    # The ranks that hold different tokens (every one but its tp peers), None: the whole world (tp_size 1).
    data_group: object = None

    @classmethod
    def initialize(cls, parallel: ParallelConfig | None = None) -> "ParallelState":
        """Join the job's process group (torchrun's env:// when launched by it, else a world of one), or reuse
        the one this process already joined, and lay the meshes of `parallel` (the recipe's section, checked against
        the world size; default: plain FSDP over every rank) over it."""
        parallel = parallel or ParallelConfig()
        use_cuda = torch.cuda.is_available()
        backend = "nccl" if use_cuda else "gloo"
        timeout = timedelta(minutes=parallel.timeout_minutes)
        if dist.is_initialized():
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
        elif launched_by_torchrun():
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
            # torchrun's workers share the store of its rendezvous, which outlives a restart (--max-restarts):
            # without a prefix of their own, the restarted workers would read the addresses the crashed ones
            # published and fail to connect to them.
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            dist.init_process_group(backend, store=dist.PrefixStore(f"llmtune/attempt_{attempt}", store), rank=rank,
                                    world_size=world_size, timeout=timeout)
        else:
            # A one-process run needs no rendezvous: an in-memory store avoids claiming a port.
            local_rank = 0
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        if use_cuda:
            torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
        world_size = dist.get_world_size()
        replicate, cp, tp = parallel.dp_replicate, parallel.cp_size, parallel.tp_size
        shard = world_size // (replicate * cp * tp)
        # FSDP2 reads a 1-D mesh as plain FSDP and a 2-D one as HSDP (replicate, shard); cp peers are shard ranks.
        # The root holds FSDP2's dimensions as they are, and the cp peers are its shard dimension unflattened: a
        # dimension flattened from the root would be sliced from it, which torch deprecates.
        root = init_device_mesh(device.type, (replicate, shard * cp, tp),
                                mesh_dim_names=("dp_replicate", "dp_shard_cp", "tp"))
        mesh = root._unflatten("dp_shard_cp", (shard, cp), ("dp_shard", "cp"))
        fsdp_mesh = root["dp_replicate", "dp_shard_cp"] if replicate > 1 else root["dp_shard_cp"]
        ep = parallel.expert_parallel
        # Consecutive ep ranks (the innermost dimension), like cp peers: on a node they are its GPUs, over which
        # the all-to-alls run. One root mesh for both: FSDP2 shards a DTensor of its ep dimension over its efsdp one.
        # Under tp the ep groups take in tp peers, which route tokens of their own (model/tensor_parallel.py).
        expert_mesh = init_device_mesh(device.type, (replicate, shard * tp // ep, ep),
                                       mesh_dim_names=("dp_replicate", "efsdp", "ep")) if ep > 1 else None
        wait_group = dist.new_group(backend="gloo", timeout=LONG_WAIT)
        data_group = root["dp_replicate", "dp_shard_cp"]._flatten("data").get_group() if tp > 1 else None
        return cls(dist.get_rank(), world_size, local_rank, device, mesh, fsdp_mesh, wait_group, parallel,
                   expert_mesh, data_group)

    @property
    def cp_size(self) -> int:
        return self.parallel.cp_size

    @property
    def shard_size(self) -> int:
        """The ranks each parameter is sharded over (dp_shard x cp)."""
        return self.parallel.shard_size(self.world_size)

    @property
    def tp_size(self) -> int:
        return self.parallel.tp_size

    @property
    def dp_size(self) -> int:
        return self.parallel.data_parallel_size(self.world_size)

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.cp_size * self.tp_size)

    @property
    def cp_rank(self) -> int:
        return self.rank // self.tp_size % self.cp_size

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def parameter_device(self) -> torch.device:
        """Where the sharded parameters live: the CPU under parallel.cpu_offload (FSDP2 copies each layer to the
        device for its forward and backward), else the device."""
        return torch.device("cpu") if self.parallel.cpu_offload else self.device

    def shard_options(self, experts: bool = False) -> dict:
        """fully_shard's arguments of the layout for a decoder layer or the root, or with `experts` for an experts
        module split over the ep ranks: the mesh the parameters are sharded over (2-D under HSDP; the experts' efsdp
        ranks, under HSDP with dp_replicate), their offload (CPUOffloadPolicy: parameters, gradients and the optimizer's
        step on the CPU, the copies to a GPU from pinned memory) and what a layer keeps after its forward."""
        offload = CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if self.parallel.cpu_offload \
            else OffloadPolicy()
        mesh, after = self.fsdp_mesh, self.parallel.reshard_after_forward
        if experts:
            mesh = self.expert_mesh["dp_replicate", "efsdp"] if self.parallel.dp_replicate > 1 \
                else self.expert_mesh["efsdp"]
            # reshard_after_forward n names groups of the dense layers' shard ranks (a node's GPUs); the efsdp ranks
            # of an expert are one per ep group, across them: where n does not divide them, the experts reshard
            # fully (their gathered share, E / ep experts, is the small one).
            if not isinstance(after, bool) and self.expert_mesh["efsdp"].size() % after:
                after = True
        return {"mesh": mesh, "offload_policy": offload, "reshard_after_forward": after}

    def accumulate(self, model, last: bool) -> None:
        """Set `model` (FSDP2) for a micro-batch of a step; `last`: the step's last one. By default each micro-batch's
        gradients are reduce-scattered within the replica group, which keeps only sharded gradients between
        micro-batches, and all-reduced across groups (HSDP) at the last alone. parallel.reshard_between_micro_batches
        false keeps the gathered weights and whole gradients until the last, whose backward reduces them once."""
        if self.parallel.reshard_between_micro_batches:
            model.set_requires_gradient_sync(True)
            model.set_requires_all_reduce(last)
        else:
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)

    @property
    def fsdp_group_size(self) -> int:
        """Ranks over which FSDP averages gradients: every rank but its tp peers, HSDP's replica groups included."""
        return self.world_size // self.tp_size

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks that hold different tokens: tp peers compute the same micro-batch and hold the
        same counts and sums, which are counted once."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.data_group)
        return tensor

    def all_agree(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on every rank."""
        agreed = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        return bool(agreed.item())

    def highest(self, values: list[int]) -> list[int]:
        """Each of `values`, the largest of every rank's, on every rank (one collective)."""
        highest = torch.tensor(values, device=self.device)
        dist.all_reduce(highest, op=dist.ReduceOp.MAX)
        return highest.tolist()

    def broadcast_object(self, obj, group=None):
        """Rank 0's `obj` (picklable), on every rank."""
        holder = [obj]
        dist.broadcast_object_list(holder, src=0, group=group)
        return holder[0]

    def cp_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of `tensor` over the cp peers (a copy; no gradient flows through it)."""
        total = tensor.detach().clone()
        if self.cp_size > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.mesh.get_group("cp"))
        return total

    def cp_all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        """Among the cp peers: send[i] goes to peer i; returns what each peer sent here, in peer order."""
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.mesh.get_group("cp"))
        return received

    def background_group(self):
        """A gloo group of every rank beside the training one, for collectives that run in a background thread
        while training goes on (asynchronous checkpoint saves). Every rank must call it, in the same order."""
        return dist.new_group(backend="gloo")

    def gather_object(self, obj) -> list | None:
        """Every rank's `obj` (picklable) in rank order, on rank 0; None on the others."""
        gathered = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, gathered, dst=0)
        return gathered

    def barrier(self) -> None:
        dist.barrier()

    def all_gather_object(self, obj, group=None) -> list:
        """Every rank's `obj` (picklable) in rank order, on every rank."""
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=group)
        return gathered

    def first_error(self, error: str | None, group=None) -> str | None:
        """Every rank learns the first rank's error message (None when no rank had one)."""
        return next((e for e in self.all_gather_object(error, group) if e), None)

    def run_first(self, here: bool, work, group):
        """work() on the ranks where `here` holds while the others wait. Every rank returns rank 0's result, or
        raises the first UserError any rank met, so that no rank goes on alone."""
        result, error = None, None
        if here:
            try:
                result = work()
            except UserError as err:
                error = str(err)
        error = self.first_error(error, group)
        if error:
            raise UserError(error)
        return self.broadcast_object(result, group)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
