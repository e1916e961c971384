"""Expert parallelism's token dispatch: the experts of each mixture-of-experts layer split over the ranks of an
expert-parallel (EP) group, each (token, expert) pair sent to the rank holding its expert and its output sent back.

The seam is transformers' own: every MoE family llmtune supports (Qwen2/3-MoE, Mixtral, OLMoE, gpt-oss,
DeepSeek-V3, ...) decorates its experts module with `use_experts_implementation`, whose forward(hidden_states [T, H],
top_k_index [T, k], top_k_weights [T, k]) calls the function `config._experts_implementation` names in
ALL_EXPERTS_FUNCTIONS. `expert_parallel_forward`, registered there as EXPERT_PARALLEL, serves every such family
with no code of its own: on the rank that holds an expert, the family's own implementation (the one the model used
before, eager, grouped_mm, ...) computes it, with the family's biases, gate activation and layout.

A rank r of an EP group of N holds experts [r*E/N, (r+1)*E/N) (`shard_experts`: DTensors sharded on dim 0). Per
layer and micro-batch:
1. the T x k (token, expert) pairs sorted by expert, so that the pairs for each rank are contiguous;
2. the per-expert counts exchanged (one all-to-all of N x E/N integers, read back to the host for the splits);
3. the pairs' hidden states exchanged with variable splits (autograd-aware all-to-all: its backward sends the
   gradients back the same way);
4. the local experts run on what arrived, each row with unit routing weight;
5. the outputs exchanged back, put in the (token, k) order again, weighted and summed over k on the rank that
   holds the token, as the families' own forwards do (output x weight, then the sum over k): no pair is dropped
   and there is no capacity limit.

The routing weights never leave their rank, so their gradient is computed where the router is.
"""

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

EXPERT_PARALLEL = "llmtune_expert_parallel"


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's experts modules that go through transformers' experts seam (`use_experts_implementation`
    sets `_is_expert_parallel` on each it builds), found by structure, whatever the family calls them."""
    return [module for module in model.modules() if hasattr(module, "_is_expert_parallel")]


def expert_parallel_problem(model: torch.nn.Module, degree: int) -> str | None:
    """Why the experts of `model` cannot be split over `degree` ranks, or None."""
    modules = experts_modules(model)
    if not modules:
        return (f"parallel.expert_parallel: {degree} needs a mixture-of-experts model whose experts use "
                f"transformers' experts implementations; {type(model).__name__} has none: set it to 1")
    counts = sorted({module.num_experts for module in modules})
    if any(count % degree for count in counts):
        return (f"parallel.expert_parallel: {degree} does not divide the {' or '.join(map(str, counts))} experts "
                f"of {type(model).__name__}'s layers; use a divisor of {counts[0]}")
    return None


def shard_experts(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    """Split each experts module of `model` over the 1-D expert-parallel `mesh`: its parameters become DTensors
    sharded on dim 0 (every parameter of an experts module is per expert: gate_up_proj, down_proj, gpt-oss's
    biases), this rank keeping its 1/N of the experts, and the model's experts go through EXPERT_PARALLEL. DTensors,
    so that FSDP2 can shard each expert further over other ranks of the same mesh's root (torchtitan's efsdp x ep)
    and checkpoints see the whole tensor's shape. The module's num_experts stays the model's (what the FLOP count
    and the router read); `local_experts` is this rank's share."""
    for module in experts_modules(model):
        for name, parameter in list(module.named_parameters(recurse=False)):
            # Every rank holds the same whole tensor: each keeps its rows, with no communication.
            rows = distribute_tensor(parameter.detach(), mesh, [Shard(0)], src_data_rank=None)
            setattr(module, name, torch.nn.Parameter(rows, requires_grad=parameter.requires_grad))
        module.local_experts = module.num_experts // mesh.size()
        module.expert_parallel_group = mesh.get_group()
        module.local_experts_forward = _implementation(module, model.config._experts_implementation)
        module.sent_bytes = 0
    # transformers accepts only registered names; registering again replaces the entry with itself.
    ALL_EXPERTS_FUNCTIONS.register(EXPERT_PARALLEL, expert_parallel_forward)
    model.set_experts_implementation(EXPERT_PARALLEL)


def split_experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The experts modules of `model` that shard_experts split."""
    return [module for module in experts_modules(model) if hasattr(module, "expert_parallel_group")]


def _implementation(module: torch.nn.Module, name: str):
    """The experts function `name` means for `module`: a registered one, or for eager the class's own forward
    (which the decorator wrapped)."""
    return ALL_EXPERTS_FUNCTIONS.get_interface(name, type(module).forward.__wrapped__)


def expert_parallel_forward(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' output [T, H] for this rank's tokens, the experts spread over `module.expert_parallel_group`
    (see the module's doc)."""
    group, local = module.expert_parallel_group, module.local_experts
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    tokens, top_k = top_k_index.shape
    pairs = top_k_index.reshape(-1)
    order = torch.argsort(pairs, stable=True)
    sent_per_expert = torch.bincount(pairs, minlength=local * ranks).view(ranks, local)
    received_per_expert = torch.empty_like(sent_per_expert)
    dist.all_to_all_single(received_per_expert, sent_per_expert, group=group)
    sent, received = torch.stack([sent_per_expert.sum(dim=1), received_per_expert.sum(dim=1)]).tolist()
    if torch.is_grad_enabled():  # a training forward: the all-to-all volume metric's (ExpertParallel.step_metrics)
        rows_out = sum(sent) - sent[me] + sum(received) - received[me]  # dispatched, then returned
        module.sent_bytes += rows_out * hidden_states.shape[-1] * hidden_states.element_size()
    rows = _exchange(hidden_states[order // top_k], received, sent, group)
    experts = torch.arange(local, device=rows.device).repeat(ranks).repeat_interleave(received_per_expert.flatten())
    outputs = _run_local_experts(module, rows, experts[:, None])
    back = _exchange(outputs, sent, received, group)
    # The hidden size named: a rank may hold no token (a tp rank's share of one decoded position).
    unsorted = torch.empty_like(back).index_copy(0, order, back).view(tokens, top_k, back.shape[-1])
    return (unsorted * top_k_weights[..., None]).sum(dim=1).to(hidden_states.dtype)


def _exchange(rows: torch.Tensor, received: list[int], sent: list[int], group) -> torch.Tensor:
    """All-to-all of `rows` (sent[i] of them to rank i, received[i] from it), whose backward sends the gradients
    back the same way. torch's functional collective (torch.distributed.nn.functional's is deprecated), waited on
    here: its result holds no data until then, and the experts' kernels read it directly."""
    return wait_tensor(all_to_all_single_autograd(rows, received, sent, group))


def _run_local_experts(module, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The family's own experts function on the rows that arrived (top-1, unit weights), on this rank's rows of the
    experts' parameters. With no row, one zero row goes through instead and is dropped: its output then depends on
    the received rows and the local experts, so that this rank's backward takes part in the all-to-alls' backward
    like every other rank's, and its experts get (zero) gradients."""
    weights = rows.new_ones(len(rows), 1)
    with _local_parameters(module):
        if len(rows):
            return module.local_experts_forward(module, rows, experts, weights)
        return module.local_experts_forward(module, rows.sum(dim=0, keepdim=True), experts.new_zeros(1, 1),
                                            weights.new_ones(1, 1))[:0]


@contextmanager
def _local_parameters(module):
    """The module's DTensor parameters replaced by this rank's rows of them, and its num_experts by their count, while
    the family's function runs (its kernels take plain tensors, its loops and one-hots count the experts it holds);
    their backward gives the DTensors their gradients."""
    sharded = {name: p for name, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
    module._parameters.update({name: p.to_local() for name, p in sharded.items()})
    module.num_experts, total = module.local_experts, module.num_experts
    try:
        yield
    finally:
        module._parameters.update(sharded)
        module.num_experts = total
