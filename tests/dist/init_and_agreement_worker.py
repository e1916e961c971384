"""Run by torchrun (2 processes) from test_init_and_agreement.py, three cases in one launch, each a run built as the
worker builds it (no training): `torchrun --nproc-per-node 2 tests/dist/init_and_agreement_worker.py SPEC.json`.

1. disagree: rank 1 reads another train.learning_rate than rank 0; each rank writes the message of the error it
   stopped with to OUT/disagree_rank<R>.txt.
2. lenient: a pretrained folder that lacks tensors, loaded with model.strict_load false; rank 0 saves the full value
   of every parameter to OUT/lenient.pt.
3. init_from: a checkpoint saved on one rank; rank 0 saves the full value of every parameter to OUT/init_from.pt.
"""

import json
import sys
from pathlib import Path

import torch

from llmtune.config import load_config
from llmtune.errors import UserError
from llmtune.run.parallel import ParallelState
from llmtune.run.process_exit import run_and_exit
from llmtune.run.worker import build_trainer


def full_parameters(config, state: ParallelState) -> dict[str, torch.Tensor]:
    trainer, _ = build_trainer(config, state)
    return {name: param.full_tensor() for name, param in trainer.model.hf_model.named_parameters()}


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    state = ParallelState.initialize()
    try:
        disagree = spec["disagree"] + (["train.learning_rate=0.5"] if state.rank == 1 else [])
        try:
            build_trainer(load_config(spec["recipe"], disagree, "sft", state.world_size), state)
            message = "no error"
        except UserError as err:
            message = str(err)
        (out / f"disagree_rank{state.rank}.txt").write_text(message)
        for case in ("lenient", "init_from"):
            params = full_parameters(load_config(spec["recipe"], spec[case], "sft", state.world_size), state)
            if state.is_main:
                torch.save(params, out / f"{case}.pt")
    finally:
        state.close()


if __name__ == "__main__":
    run_and_exit(lambda: main(sys.argv[1]))
