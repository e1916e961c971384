"""How a step's inputs reach the device and what FSDP2 keeps gathered (docs/training.md, "Copies and collectives"),
on one process: the collator gives each tensor of a micro-batch as one contiguous block of its own (what the
DataLoader pins on CUDA and one copy moves); Trainer.prepare copies each tensor of every micro-batch to the device
once, non_blocking, the features' additions included, but for the inputs the host reads inside the forward (the
document spans), which stay in host memory; after a forward, every decoder layer but the last has freed its gathered
weights, and the last keeps them for the backward that follows at once."""

import pytest
import torch
import yaml
from torch.distributed.tensor import DTensor

from llmtune.config import load_config
from llmtune.data.collate import HOST_INPUTS
from llmtune.model.build import decoder_layers
from llmtune.run.parallel import ParallelState
from llmtune.run.worker import build_trainer


@pytest.fixture(scope="module")
def trainer(tiny_model, sft_file, tmp_path_factory):
    """sft on packed rows: 4 micro-batches of 2 rows a step."""
    root = tmp_path_factory.mktemp("copies")
    (root / "recipe.yaml").write_text(yaml.safe_dump({
        "model": {"name_or_path": str(tiny_model)},
        "data": {"train_files": [str(sft_file)], "chat_template": "basic", "max_seq_len": 128},
        "train": {"output_dir": str(root), "max_steps": 1, "per_device_train_batch_size": 2,
                  "global_batch_size": 8, "learning_rate": 1e-3},
    }))
    state = ParallelState.initialize()
    try:
        built, _ = build_trainer(load_config(str(root / "recipe.yaml"), [], "sft", world_size=1), state)
        yield built
    finally:
        state.close()


def tensors(batch) -> list[torch.Tensor]:
    return [value for value in (*batch.inputs.values(), *batch.sequences.values()) if isinstance(value, torch.Tensor)]


def test_each_tensor_of_each_micro_batch_is_one_block_copied_to_the_device_once(trainer, monkeypatch):
    _, micro_batches = next(trainer.data.steps(1))
    assert len(micro_batches) == 4
    for batch in micro_batches:
        held = tensors(batch)
        assert all(tensor.is_contiguous() for tensor in held)
        assert len({tensor.untyped_storage().data_ptr() for tensor in held}) == len(held)
    moves = []
    to = torch.Tensor.to

    def counted(tensor, *args, **kwargs):
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, (torch.device, str)):  # a move to a device, not a change of dtype
            moves.append((id(tensor), kwargs.get("non_blocking", False)))
        return to(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counted)
    step = trainer.prepare(micro_batches)
    monkeypatch.undo()
    # On a CPU the copy is the tensor itself: each prepared tensor is one that was moved, once, but the host's.
    inputs = step.batches[0].inputs
    assert {"labelled", "document_positions", "document_spans"} <= set(inputs)
    host = {id(batch.inputs[name]) for batch in step.batches for name in HOST_INPUTS if name in batch.inputs}
    prepared = [tensor for batch in step.batches for tensor in tensors(batch) if id(tensor) not in host]
    assert sorted(moves) == sorted((id(tensor), True) for tensor in prepared)


def test_the_last_layer_keeps_its_weights_gathered_after_its_forward(trainer):
    _, micro_batches = next(trainer.data.steps(1))
    batch = trainer.prepare(micro_batches[:1]).batches[0]
    layers = decoder_layers(trainer.model.hf_model)
    assert len(layers) > 1
    with torch.no_grad():
        trainer.model(**batch.inputs)
    sharded = [all(isinstance(param, DTensor) for param in layer.parameters()) for layer in layers]
    assert sharded == [True] * (len(layers) - 1) + [False]
