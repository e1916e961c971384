"""Training cases of the multi-process tests: run in pytest's process (world of one) or under torchrun
(`torchrun --nproc-per-node N tests/dist/case_worker.py CASES.json`), one case after another in one launch.

Each case trains a recipe (task, overrides, and the context-parallel attention's document window) as the
worker does, exports when the recipe says so, and leaves in its output_dir, besides the run's own outputs:
grads.pt, every parameter's full gradient at step 1, taken just before the optimizer step; and, for a case
with a `probe` (token ids), logits.pt, the trained model's logits on it. A `resave` case trains nothing: it saves
again at once the checkpoint it resumed from, as its own layout holds it after the load. A `float8` case trains
with float8 matmuls on the CPU: torch's emulation, the weights all-gathered in float8 over gloo (tests/helpers.py).
A case with a `compile_backend` compiles its layers (train.compile) with that torch.compile backend, e.g. aot_eager:
the graphs inductor would get, forward and backward, run by eager kernels, without inductor's C++ builds in every
process.
"""

import contextlib
import json
import os
import sys
from pathlib import Path

import torch

from llmtune.checkpoint.hf_export import export_trained
from llmtune.config import load_config
from llmtune.model import attention
from llmtune.run.parallel import ParallelState
from llmtune.run.process_exit import run_and_exit
from llmtune.run.worker import build_trainer


def run_case(recipe: str, overrides: list[str], world_size: int, keep_process_group: bool = False, task: str = "sft",
             probe: list[int] | None = None, resave: bool = False) -> None:
    """keep_process_group: leave the process group for the next case (a torchrun worker cannot join a second)."""
    config = load_config(recipe, overrides, task, world_size)
    output_dir = Path(config.train.output_dir)
    state = ParallelState.initialize(config.parallel)
    try:
        trainer, tokenizer = build_trainer(config, state)
        if resave:
            trainer.checkpoints.save(trainer.step, trainer.model, trainer.optimizer, trainer.state_dict())
            return
        step = trainer.optimizer.step

        def capture_then_step(*args, **kwargs):
            if trainer.step == 0:
                grads = {name: p.grad.full_tensor() for name, p in trainer.model.hf_model.named_parameters()
                         if p.grad is not None}
                if state.is_main:
                    torch.save(grads, output_dir / "grads.pt")
            return step(*args, **kwargs)

        trainer.optimizer.step = capture_then_step
        trainer.train()
        if probe:
            trainer.model.eval()
            with torch.no_grad():
                logits = trainer.model(torch.tensor([probe], device=state.device))
            if state.is_main:
                torch.save(logits.cpu(), output_dir / "logits.pt")
        if config.checkpoint.export_hf:
            export_trained(trainer.model, tokenizer, output_dir, config.checkpoint, state,
                           trainer.features)
    finally:
        if not keep_process_group:
            state.close()


def main(spec: str) -> None:
    cases = json.loads(Path(spec).read_text())
    default_window = attention.DOCUMENT_WINDOW
    for number, case in enumerate(cases, start=1):
        # A window shorter than the test's sequences makes the attention go document span by span.
        attention.DOCUMENT_WINDOW = case.get("document_window") or default_window
        with contextlib.ExitStack() as stack:
            if case.get("float8"):
                # Here, not at the top: the launches that run no float8 case need not put the repository on the path.
                from tests.helpers import emulated_float8_matmul, gloo_float8_all_gather

                stack.enter_context(emulated_float8_matmul())
                stack.enter_context(gloo_float8_all_gather())
            if case.get("compile_backend"):
                import pytest

                from tests.helpers import compile_with_backend

                compile_with_backend(stack.enter_context(pytest.MonkeyPatch.context()), case["compile_backend"])
            run_case(case["recipe"], case["overrides"], int(os.environ["WORLD_SIZE"]),
                     keep_process_group=number < len(cases), task=case.get("task", "sft"), probe=case.get("probe"),
                     resave=case.get("resave", False))


if __name__ == "__main__":
    run_and_exit(lambda: main(sys.argv[1]))
