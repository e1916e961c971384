"""Run by torchrun (gloo) from test_expert_parallel.py, as `expert_parallel_worker.py MODE OUT`, for each
mixture-of-experts family of tests/model_matrix.py: build the tiny model (the same on every rank), keep a copy
unsplit, split the other's experts over the ranks (llmtune/model/expert_parallel.py), run both and append one JSON
line per case and rank to OUT/reports.jsonl: the case, and the differences beyond fp32's tolerance (1e-5 relative).

MODE dispatch (2 processes, ep 2): for each experts implementation the family may compute with (eager: the class's
own loop, grouped_mm: transformers' default), the first MoE layer's experts module alone, unsplit on every rank's
tokens together, split on this rank's own: output, and gradients w.r.t. hidden states, routing weights and this
rank's experts' parameters; and the bytes the experts module counts as sent to the other rank (the all-to-all
volume metric's).

MODE fsdp (4 processes, ep 2 x efsdp 2): the whole model, its experts split over ep and each expert sharded by FSDP2
over the other two ranks, everything else sharded by FSDP2 over all four, each rank on a batch of its own: the
rank's loss against the unsplit model's on the same batch, and every parameter's gradient (gathered) against the
unsplit model's for the four batches together, averaged as FSDP averages over the data-parallel ranks; then the
gradient norm llmtune clips with, and the clipped gradients, against torch's clip_grad_norm_ of the unsplit model;
last, every parameter set from a whole value rank by rank (model/state.copy_rows) reads back as it (whole)."""

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from llmtune.model.expert_parallel import experts_modules, shard_experts
from llmtune.model.state import copy_rows, whole
from llmtune.training.trainer import clip_gradients
from tests.model_matrix import FAMILIES

TOKENS = 12  # per rank
VOCAB = 64
MAX_NORM = 0.5  # far below the tiny models' summed-loss gradient norms (tens): the clipping acts
# Each case's routing: random experts per token, or every token to the first rank's experts (the second then
# receives no row, and must still take part in the backward's all-to-alls).
ROUTINGS = ("random", "first_rank_only")


def routing(case: str, tokens: int, experts: int, top_k: int, generator) -> torch.Tensor:
    if case == "first_rank_only":
        return torch.stack([torch.randperm(experts // 2, generator=generator)[:top_k] for _ in range(tokens)])
    return torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])


def differences(name: str, got: torch.Tensor, expected: torch.Tensor) -> list[str]:
    try:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    except AssertionError as error:
        return [f"{name}: {str(error).splitlines()[1:4]}"]
    return []


def tiny_model(family, implementation: str):
    """The family's tiny model, the same on every rank, computing its experts with `implementation`."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family.hf_config(vocab_size=VOCAB), dtype=torch.float32)
    model.set_experts_implementation(implementation)
    return model


def check_dispatch(family, implementation: str, case: str) -> dict:
    rank, ranks = dist.get_rank(), dist.get_world_size()
    model = tiny_model(family, implementation)
    unsplit = copy.deepcopy(model)
    shard_experts(model, init_device_mesh("cpu", (ranks,), mesh_dim_names=("ep",)))
    experts, reference = experts_modules(model)[0], experts_modules(unsplit)[0]
    total, hidden_size, top_k = reference.num_experts, model.config.hidden_size, model.config.num_experts_per_tok

    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(ranks * TOKENS, hidden_size, generator=generator)
    index = routing(case, ranks * TOKENS, total, top_k, generator)
    weights = torch.rand(ranks * TOKENS, top_k, generator=generator)
    cotangent = torch.randn(ranks * TOKENS, hidden_size, generator=generator)
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)

    hidden_all, weights_all = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
    expected = reference(hidden_all, index, weights_all)
    (expected * cotangent).sum().backward()
    hidden_mine, weights_mine = hidden[mine].clone().requires_grad_(), weights[mine].clone().requires_grad_()
    got = experts(hidden_mine, index[mine], weights_mine)
    (got * cotangent[mine]).sum().backward()

    local = experts.local_experts
    found = differences("output", got, expected[mine].detach())
    # The all-to-all volume metric's count: this rank's pairs for the other rank's experts (dispatched) and the other
    # rank's pairs for this one's (returned), each a row of hidden states in fp32.
    owner, others = index // local, torch.ones(len(index), dtype=torch.bool)
    others[mine] = False
    crossing = int((owner[mine] != rank).sum() + (owner[others] == rank).sum())
    if experts.sent_bytes != crossing * hidden_size * 4:
        found.append(f"sent_bytes {experts.sent_bytes}, expected {crossing * hidden_size * 4}")
    found += differences("hidden_states grad", hidden_mine.grad, hidden_all.grad[mine])
    found += differences("top_k_weights grad", weights_mine.grad, weights_all.grad[mine])
    for name, parameter in reference.named_parameters():
        found += differences(f"{name} grad", getattr(experts, name).grad.to_local(),
                             parameter.grad[rank * local:(rank + 1) * local])
    return {"rank": rank, "family": family.name, "implementation": implementation, "routing": case,
            "dispatch": experts.config._experts_implementation,
            "local_compute": experts.local_experts_forward.__name__, "local_experts": local,
            "local_shapes": [list(parameter.to_local().shape) for parameter in experts.parameters()], "differences": found}


def summed_loss(model, input_ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=input_ids).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), input_ids[:, 1:].reshape(-1), reduction="sum")


def compared_gradients(model, unsplit, what: str) -> list[str]:
    """The differences of every gradient of `model` (gathered) from the unsplit model's."""
    unsplit_parameters = dict(unsplit.named_parameters())
    return [line for name, parameter in model.named_parameters()
            for line in differences(f"{what}{name} grad", parameter.grad.full_tensor(), unsplit_parameters[name].grad)]


def check_fsdp(family) -> dict:
    rank, ranks = dist.get_rank(), dist.get_world_size()
    model = tiny_model(family, "grouped_mm")
    unsplit = copy.deepcopy(model)
    # Expert-parallel ranks consecutive (the innermost dimension), like context-parallel peers: on a node they are
    # its GPUs, over which the all-to-alls run.
    mesh = init_device_mesh("cpu", (ranks // 2, 2), mesh_dim_names=("efsdp", "ep"))
    shard_experts(model, mesh["ep"])
    for layer in model.model.layers:
        for experts in experts_modules(layer):
            fully_shard(experts, mesh=mesh["efsdp"])
            # FSDP averages an expert's gradient over the efsdp ranks alone, while it holds the tokens of every
            # data-parallel rank (the ep ranks sent theirs): divided by all of them, as a dense weight's is. A
            # factor other than the group's size needs a premultiplied sum, which gloo lacks: sums and a scaling.
            experts.set_gradient_divide_factor(ranks)
            experts.set_force_sum_reduction_for_comms(True)
        fully_shard(layer, mesh=mesh._flatten("dp"))
    fully_shard(model, mesh=mesh._flatten("dp"))

    batches = torch.randint(3, VOCAB, (ranks, 2, 16), generator=torch.Generator().manual_seed(2))
    loss = summed_loss(model, batches[rank])
    loss.backward()
    expected = [summed_loss(unsplit, batch) for batch in batches]
    sum(expected).backward()
    found = differences("loss", loss.detach(), expected[rank].detach())
    for parameter in unsplit.parameters():
        parameter.grad /= ranks
    found += compared_gradients(model, unsplit, "")
    # Clipped over the whole model's norm, each expert counted once though the experts' DTensors lie on another mesh.
    norm = clip_gradients(list(model.parameters()), MAX_NORM)
    expected_norm = torch.nn.utils.clip_grad_norm_(unsplit.parameters(), MAX_NORM)
    found += differences("grad norm", norm.float(), expected_norm)
    found += compared_gradients(model, unsplit, "clipped ")
    # What checkpoints, exports and pretrained loading go through: a parameter set from its whole value, each rank
    # copying its rows, reads back as that value.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            value = torch.randn(parameter.shape, generator=torch.Generator().manual_seed(3))
            copy_rows(parameter, value)
            if not torch.equal(whole(parameter), value):
                found.append(f"{name}: its rows copied from a value do not read back as it")
    return {"rank": rank, "family": family.name, "grad_norm": norm.item(), "experts_placements": [
        str(parameter.placements) for parameter in experts_modules(model)[0].parameters()], "differences": found}


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    families = [family for family in FAMILIES if family.mixture_of_experts]
    try:
        if mode == "dispatch":
            reports = [check_dispatch(family, implementation, case) for family in families
                       for implementation in ("eager", "grouped_mm") for case in ROUTINGS]
        else:
            reports = [check_fsdp(family) for family in families]
    finally:
        dist.destroy_process_group()
    with open(out / "reports.jsonl", "a") as f:
        f.writelines(json.dumps(line) + "\n" for line in reports)


if __name__ == "__main__":
    main()
