"""Run by torchrun (2 processes) from test_load_and_guard.py; writes one JSON line per rank to argv[3].

1. Builds a pretrained model with meta init and shard-by-shard loading, reporting the growth of
   peak RSS while loading, and checks the loaded weights against the checkpoint file.
2. Trains with a NaN injected into rank 1's loss at chosen steps, reporting what each rank saw.
"""

import json
import resource
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from llmtune.config import load_config
from llmtune.errors import TrainingStopped
from llmtune.features.base import Features
from llmtune.model.build import build_model, load_model_config
from llmtune.run.parallel import ParallelState
from llmtune.run.process_exit import run_and_exit
from llmtune.run.worker import build_trainer

NAN_STEPS = {2, 4, 5, 6}  # step 2 alone, then three in a row: max_skipped_steps=3 stops the run at step 6


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def load_report(big_model: str, recipe: str, state: ParallelState) -> dict:
    config = load_config(recipe, [f"model.name_or_path={big_model}"], "sft", state.world_size)
    before = peak_rss_mib()
    model = build_model(load_model_config(config.model), config.model, config.train, state, Features([]))
    grown = peak_rss_mib() - before
    expected = load_file(Path(big_model) / "model.safetensors")
    mismatched = [name for name, param in model.hf_model.named_parameters()
                  if not torch.equal(param.full_tensor(), expected[name].float())]
    return {"load_rss_growth_mib": grown, "mismatched": mismatched}


def guard_report(recipe: str, state: ParallelState) -> dict:
    config = load_config(recipe, [], "sft", state.world_size)
    trainer, _ = build_trainer(config, state)
    forward = trainer.model.forward
    seen = {"weights_changed": {}}

    def poisoned(*args, **kwargs):
        loss = forward(*args, **kwargs)
        return loss * float("nan") if state.rank == 1 and trainer.step + 1 in NAN_STEPS else loss

    trainer.model.forward = poisoned
    step_fn = trainer.train_step

    def watched(micro_batches):
        before = [p.to_local().clone() for p in trainer.model.parameters()]
        stats = step_fn(micro_batches)
        after = list(trainer.model.parameters())
        seen["weights_changed"][trainer.step + 1] = any(not torch.equal(b, a.to_local()) for b, a in zip(before, after))
        return stats

    trainer.train_step = watched
    try:
        trainer.train()
        seen["stopped"] = None
    except TrainingStopped as err:
        seen["stopped"] = str(err)
    seen["last_step"] = trainer.step
    return seen


def main() -> None:
    big_model, recipe, out = sys.argv[1:4]
    state = ParallelState.initialize()
    try:
        report = {"rank": state.rank, **load_report(big_model, recipe, state), **guard_report(recipe, state)}
    finally:
        state.close()
    with open(out, "a") as f:
        f.write(json.dumps(report) + "\n")


if __name__ == "__main__":
    run_and_exit(main)
