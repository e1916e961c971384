"""What each micro-batch of an accumulation leaves behind, on one process: by default its gradients are
reduce-scattered into the sharded parameters' and its layers resharded at once (the all-reduce across HSDP's replica
groups waits for the step's last micro-batch); with parallel.reshard_between_micro_batches false nothing is reduced
and the layers stay gathered until the last. Both train the same losses (1e-5)."""

import pytest
from torch.distributed.tensor import DTensor

import llmtune
from llmtune.model.build import decoder_layers
from tests.helpers import read_metrics
from llmtune.training.callbacks import Callback


class BetweenMicroBatches(Callback):
    """After each micro-batch but a step's last: whether the layers' registered parameters are their shards (else the
    gathered weights), whether they hold a gradient (sharded: reduced; gathered: whole, unreduced), and FSDP2's
    all-reduce flag (private: what HSDP's replica groups would do)."""

    def __init__(self):
        self.seen = []

    def on_substep_end(self, args, state, control, model=None, **kwargs):
        layers = decoder_layers(model)
        params = [p for layer in layers for p in layer.parameters()]
        groups = [layer._get_fsdp_state()._fsdp_param_group for layer in layers]
        self.seen.append((all(isinstance(p, DTensor) for p in params), all(p.grad is not None for p in params),
                          frozenset(group.all_reduce_grads for group in groups)))


@pytest.mark.slow
def test_micro_batches_reduce_and_reshard_unless_told_to_keep_their_layers(tiny_model, sft_file, tmp_path):
    losses = {}
    for between in (True, False):
        out, seen = tmp_path / f"between_{between}", BetweenMicroBatches()
        llmtune.train("sft", {"model": {"name_or_path": tiny_model},
                              "data": {"train_files": [sft_file], "chat_template": "basic", "max_seq_len": 64},
                              "train": {"output_dir": out, "max_steps": 2, "per_device_train_batch_size": 2,
                                        "gradient_accumulation_steps": 3, "logging_steps": 1, "learning_rate": 5e-3},
                              "parallel": {"reshard_between_micro_batches": between},
                              "checkpoint": {"export_hf": False}, "monitor": {"plots": False}},
                      callbacks=[seen])
        assert len(seen.seen) == 4  # two steps of three micro-batches: two boundaries each
        expected = (True, True, frozenset({False})) if between else (False, True, frozenset({False}))
        assert set(seen.seen) == {expected}
        losses[between] = [r["loss"] for r in read_metrics(out)]
    assert len(losses[True]) == 2
    assert losses[False] == pytest.approx(losses[True], rel=1e-5)
