"""llmtune: FSDP2 fine-tuning of HF causal language models, correct by construction."""

import logging

__version__ = "0.1.0"

# Wherever torchao is installed (the qlora extra), transformers imports it with its modeling code, and the import
# logs that torchao's CUDA kernels do not load (on a machine without them) and that a registration torchao makes in
# torch is deprecated: lines on every run about nothing llmtune uses (NF4 is plain torch code). Errors still show.
# Expert parallelism's experts lie on a 2-D (efsdp, ep) mesh, whose gradient norm and whole value (export) DTensor
# reduces or gathers one mesh dimension after the other, and warns once per process that one collective would be
# faster: for one scalar per step, and once per export. Nothing else logs there.
for _name in ("torchao", "torch.utils._pytree", "torch.distributed.tensor._redistribute"):
    logging.getLogger(_name).setLevel(logging.ERROR)


def train(task: str, recipe, callbacks=(), **overrides):
    """Train in this process, as `llmtune TASK RECIPE` does, and return the run's result.

    task: a registered task, "pt", "sft", "dpo" or "kto" (llmtune/tasks/registry.py). recipe: a YAML recipe's path, or
    the same mapping as a dict. overrides: recipe keys, as `learning_rate=1e-4` (a key one section has; the HF
    Trainer's names read as on the command line), as
    `**{"train.learning_rate": 1e-4}`, or a section's dict, `train={"learning_rate": 1e-4}`. callbacks: callback
    objects (llmtune.training.callbacks), called after those train.callbacks names.

    One process is one rank: under `torchrun --nproc-per-node N script.py` every process calls it and they train
    together. Returns a RunResult (llmtune/run/summary.py): steps and tokens, the last loss, the last and the best
    eval loss, the newest checkpoint and the export folders, on every rank. Raises what the CLI reports, with the same
    message: UserError for bad input (before any training), TrainingStopped, Preempted (a stop signal, saved).
    """
    from llmtune.run.api import run_recipe  # torch-free until the recipe has passed its checks

    return run_recipe(task, recipe, overrides, list(callbacks))
