"""Run by torchrun (2 processes, gloo) from test_loss_parallel.py: the chunked loss and log-probabilities of hidden
states split over the sequence (sequence parallelism's) and a head split over the vocabulary (loss parallel), against
the same computed whole on this process; one JSON report per case and rank in OUT/reports.jsonl."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from llmtune.model.loss import IGNORE_INDEX, LossOptions, cross_entropy_sum, token_logps

ROWS, HIDDEN, VOCAB = 2, 8, 40
# name: (the rows' length, the loss's options). Chunks of 5 and 3 rows (2 and 1 per chunk over 2 ranks) cross the
# ranks' halves of the rows; an odd length cannot be split evenly, so the hidden states are gathered whole.
CASES = {"capped_smoothed_z_loss": (12, LossOptions(chunk_size=5, z_loss=1e-3, label_smoothing=0.1,
                                                     logit_softcap=3.0)),
         "plain": (12, LossOptions(chunk_size=3)),
         "odd_length": (11, LossOptions(chunk_size=4, label_smoothing=0.1))}


def inputs(length: int):
    generator = torch.Generator().manual_seed(length)
    hidden = torch.randn(ROWS, length, HIDDEN, generator=generator)
    weight, bias = torch.randn(VOCAB, HIDDEN, generator=generator), torch.randn(VOCAB, generator=generator)
    labels = torch.randint(0, VOCAB, (ROWS, length), generator=generator)
    labels[0, :3] = labels[1, 7:] = IGNORE_INDEX
    return hidden, weight, bias, labels


def losses(hidden, weight, bias, labels, options: LossOptions):
    """(the loss, the log-probabilities at temperature 0.7 and their entropies, weighted per token into a second
    loss; the gradients of both losses w.r.t. hidden, weight and bias, gathered whole)."""
    tempered = LossOptions(chunk_size=options.chunk_size, logit_softcap=options.logit_softcap, temperature=0.7)
    results = {}
    for name in ("loss", "logps"):
        leaves = [tensor.detach().clone().requires_grad_() for tensor in (hidden, weight, bias)]
        if name == "loss":
            value = cross_entropy_sum(*leaves, labels, options)
            results[name] = [value.item()]
            value.backward()
        else:
            logps, entropy = token_logps(*leaves, labels, tempered, with_entropy=True)
            results[name], results["entropy"] = logps.flatten().tolist(), entropy.flatten().tolist()
            (logps * torch.arange(logps.numel()).view(logps.shape)).sum().backward()
        results[f"{name}_grads"] = [whole(leaf.grad).flatten().tolist() for leaf in leaves]
    return results


def whole(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def main(out: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for name, (length, options) in CASES.items():
        hidden, weight, bias, labels = inputs(length)
        expected = losses(hidden, weight, bias, labels, options)
        split = losses(distribute_tensor(hidden, mesh, [Shard(1)]), distribute_tensor(weight, mesh, [Shard(0)]),
                       distribute_tensor(bias, mesh, [Shard(0)]), labels, options)
        with open(Path(out) / "reports.jsonl", "a") as f:
            f.write(json.dumps({"case": name, "rank": dist.get_rank(), "expected": expected, "split": split}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
