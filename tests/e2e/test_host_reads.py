"""What a training step reads back from the device on the host, counted between on_step_begin and on_step_end (the
optimizer step's train_step): a read is a host wait on a GPU, and one per micro-batch would stall every micro-batch.
pt, sft, dpo and kto each read as many times with 8 micro-batches a step as with 1, and no more than docs/training.md
lists. The micro-batches' counts and the attention's document layout are read before the step, from the host copies
the collator made (Trainer.advance): on a CPU every tensor is a host one, so the step is where the device starts.
The inputs kept in host memory on any device (collate.HOST_INPUTS: the document spans the attention cuts the rows
by) and what is computed from them alone are host values there too: reading them waits for nothing, and is not
counted."""

import traceback
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import llmtune
from llmtune.data.collate import HOST_INPUTS
from llmtune.training.trainer import Trainer

aten = torch.ops.aten
# The operators whose result the host waits for: a scalar read back, or an output sized by the values it holds.
WAITING = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
           aten._unique2.default, aten.unique_consecutive.default, aten.unique_dim.default, aten.bincount.default,
           aten.repeat_interleave.Tensor, aten.equal.default}
# Reads that do not dispatch an operator on a CPU tensor (a CUDA one's copies it to the host first).
METHODS = ("tolist", "cpu", "numpy")
# What docs/training.md lists: the step's one read (its counts, loss and metric sums and gradient norm, together).
LISTED = {"pt": 1, "sft": 1, "dpo": 1, "kto": 1}


def where() -> str:
    """The innermost llmtune line on the stack: where the read was asked for."""
    frames = [f for f in traceback.extract_stack() if "/llmtune/" in f.filename and "/tests/" not in f.filename]
    return f"{frames[-1].filename.split('/llmtune/', 1)[1]}:{frames[-1].lineno} {frames[-1].name}" if frames else "?"


class HostTensors:
    """Tensors in host memory, known by identity (a WeakSet would compare tensors by value); held, so that no
    other tensor takes one's id."""

    def __init__(self):
        self.held: dict[int, torch.Tensor] = {}

    def add(self, *tensors: torch.Tensor) -> None:
        self.held.update((id(t), t) for t in tensors)

    def __contains__(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self.held


class HostReads(TorchDispatchMode):
    """Every host read of a tensor while active, each named by where() it was asked for, but those of `host`
    tensors (kept in host memory) and of what operators compute from them alone, which join them."""

    def __init__(self, host: "HostTensors"):
        super().__init__()
        self.reads: list[str] = []
        self.host = host

    def read(self, tensor: torch.Tensor, what: str) -> None:
        if tensor not in self.host:
            self.reads.append(f"{what} at {where()}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        masked = func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1])
        if func in WAITING or masked:
            self.read(args[0], str(func))
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if inputs and all(t in self.host for t in inputs):
            self.host.add(*(t for t in tree_leaves(out) if isinstance(t, torch.Tensor)))
        return out


class CountPerStep:
    """A callback: the host reads of each optimizer step, from on_step_begin to on_step_end. Trainer.prepare, which
    makes the step's micro-batches before it begins, is watched for their HOST_INPUTS (`watch`)."""

    def __init__(self):
        self.steps: list[list[str]] = []
        self.mode = None
        self.patches = []
        self.host = HostTensors()

    def watch(self):
        prepare = Trainer.prepare

        def watched(trainer, micro_batches):
            step = prepare(trainer, micro_batches)
            self.host.add(*(batch.inputs[name] for batch in step.batches for name in HOST_INPUTS
                            if name in batch.inputs))
            return step
        return mock.patch.object(Trainer, "prepare", watched)

    def on_step_begin(self, args, state, control, **kwargs):
        self.mode = HostReads(self.host)
        for name in METHODS:
            patch = mock.patch.object(torch.Tensor, name, self.counted(name, getattr(torch.Tensor, name)))
            patch.start()
            self.patches.append(patch)
        self.mode.__enter__()

    def counted(self, name, method):
        def read(tensor, *args, **kwargs):
            self.mode.read(tensor, f"Tensor.{name}")
            return method(tensor, *args, **kwargs)
        return read

    def on_step_end(self, args, state, control, **kwargs):
        self.mode.__exit__(None, None, None)
        while self.patches:
            self.patches.pop().stop()
        self.steps.append(self.mode.reads)


def recipe(task, model, data, out, micro_batch) -> dict:
    """3 optimizer steps of 8 rows each, in 1 micro-batch of 8 or in 8 of 1; packed rows of several documents."""
    return {"model": {"name_or_path": str(model)},
            "data": {"train_files": [str(data)], "max_seq_len": 64 if task == "pt" else 128,
                     **({} if task == "pt" else {"chat_template": "basic"})},
            "train": {"output_dir": str(out), "max_steps": 3, "per_device_train_batch_size": micro_batch,
                      "global_batch_size": 8, "logging_steps": 1, "learning_rate": 1e-3},
            "checkpoint": {"export_hf": False, "save_steps": 0}, "monitor": {"plots": False, "console": False}}


@pytest.fixture
def data(assets, sft_file, pairs_file, examples_file):
    return {"pt": assets / "data" / "pt.jsonl", "sft": sft_file, "dpo": pairs_file, "kto": examples_file}


@pytest.mark.slow
@pytest.mark.parametrize("task", ["pt", "sft", "dpo", "kto"])
def test_a_step_reads_as_often_with_8_micro_batches_as_with_1_and_no_more_than_listed(task, tiny_model, data,
                                                                                     tmp_path):
    counted = {}
    for micro_batch in (8, 1):
        counter = CountPerStep()
        with counter.watch():
            llmtune.train(task, recipe(task, tiny_model, data[task], tmp_path / str(micro_batch), micro_batch),
                          callbacks=[counter])
        assert len(counter.steps) == 3
        counted[micro_batch] = counter.steps
    one, eight = counted[8], counted[1]
    assert [len(reads) for reads in eight] == [len(reads) for reads in one], (one[-1], eight[-1])
    assert max(len(reads) for reads in eight) <= LISTED[task], eight[-1]
