"""Run by torchrun (2 processes, gloo) from test_expert_parallel.py: for each mixture-of-experts family of
tests/model_matrix.py and each experts implementation the family may compute with (eager: the class's own loop,
grouped_mm: transformers' default), build the tiny model (the same on every rank), keep a copy unsplit, split the
other's experts over the 2 ranks (llmtune/model/expert_parallel.py) and run the first MoE layer's experts module:
the unsplit copy on every rank's tokens together, the split one on this rank's own. Each rank appends one JSON line
per case to OUT/reports.jsonl: the case, and the differences beyond fp32's tolerance (1e-5 relative) of the output
and of the gradients w.r.t. hidden states, routing weights and this rank's experts' parameters."""

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from llmtune.model.expert_parallel import experts_modules, shard_experts
from tests.model_matrix import FAMILIES

TOKENS = 12  # per rank
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


def check(family, implementation: str, case: str) -> dict:
    rank, ranks = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family.hf_config(vocab_size=64), dtype=torch.float32)
    model.set_experts_implementation(implementation)
    unsplit = copy.deepcopy(model)
    shard_experts(model, dist.group.WORLD)
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

    local = experts.num_experts
    found = differences("output", got, expected[mine].detach())
    found += differences("hidden_states grad", hidden_mine.grad, hidden_all.grad[mine])
    found += differences("top_k_weights grad", weights_mine.grad, weights_all.grad[mine])
    for name, parameter in reference.named_parameters():
        found += differences(f"{name} grad", getattr(experts, name).grad,
                             parameter.grad[rank * local:(rank + 1) * local])
    return {"rank": rank, "family": family.name, "implementation": implementation, "routing": case,
            "dispatch": experts.config._experts_implementation,
            "local_compute": experts.local_experts_forward.__name__, "local_experts": local,
            "local_shapes": [list(parameter.shape) for parameter in experts.parameters()], "differences": found}


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    try:
        reports = [check(family, implementation, case) for family in FAMILIES if family.mixture_of_experts
                   for implementation in ("eager", "grouped_mm") for case in ROUTINGS]
    finally:
        dist.destroy_process_group()
    with open(out / "reports.jsonl", "a") as f:
        f.writelines(json.dumps(line) + "\n" for line in reports)


if __name__ == "__main__":
    main()
