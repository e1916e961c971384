"""Moving averages of the weights (train.ema_decay) on one process: the exported averages equal averages computed from
the weights after every step (fp64 reference, 1e-6 relative); evaluating them leaves training bitwise as it was;
a resumed run's averages are bitwise the uninterrupted run's. (Other world sizes: tests/dist/test_ema_layouts.py.)"""

import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

import llmtune
from llmtune.training.callbacks import Callback
from tests.helpers import StopAt, read_metrics

DECAYS = [0.5, 0.9]


def recipe(tiny_model, sft_file, output_dir, **train) -> dict:
    return {
        "model": {"name_or_path": tiny_model},
        "data": {"train_files": [sft_file], "val_files": [sft_file], "chat_template": "basic", "max_seq_len": 64,
                 "packing": False},
        "train": {"output_dir": output_dir, "max_steps": 4, "per_device_train_batch_size": 8, "logging_steps": 1,
                  "learning_rate": 5e-3, "eval_steps": 2, "per_device_eval_batch_size": 16, **train},
        "checkpoint": {"save_steps": 2, "export_dtype": "fp32"},
        "monitor": {"plots": False},
    }


def whole(param):
    return (param.full_tensor() if isinstance(param, DTensor) else param).detach().double().clone()


class Weights(Callback):
    """The trainable weights at the start and after every optimizer step, whole, in fp64."""

    def __init__(self):
        self.steps = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.steps.append({name: whole(p) for name, p in model.named_parameters() if p.requires_grad})

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({name: whole(p) for name, p in model.named_parameters() if p.requires_grad})


def test_the_exported_averages_are_those_of_the_weights_after_every_step(tiny_model, sft_file, tmp_path):
    weights = Weights()
    out = tmp_path / "run"
    llmtune.train("sft", recipe(tiny_model, sft_file, out, ema_decay=DECAYS, eval_ema=True), callbacks=[weights],
                  checkpoint={"export_ema": True})
    assert len(weights.steps) == 5
    for decay in DECAYS:
        expected = dict(weights.steps[0])
        for step in weights.steps[1:]:
            expected = {name: decay * expected[name] + (1 - decay) * value for name, value in step.items()}
        exported = load_file(out / f"hf_ema_{decay:g}" / "model.safetensors")
        shared = expected.keys() & exported.keys()
        assert len(shared) == len(expected), "every trainable weight exported under its name"
        for name in shared:
            torch.testing.assert_close(exported[name].double(), expected[name], rtol=1e-6, atol=1e-7)
    records = [r for r in read_metrics(out) if "eval_loss" in r]
    assert [r["step"] for r in records] == [2, 4]
    for record in records:
        averages = [record[f"eval_loss_ema_{decay:g}"] for decay in DECAYS]
        assert len({record["eval_loss"], *averages}) == 3, "each average evaluated as itself"

    plain = tmp_path / "plain"
    llmtune.train("sft", recipe(tiny_model, sft_file, plain))
    assert [r["loss"] for r in read_metrics(plain)] == [r["loss"] for r in read_metrics(out)], \
        "keeping and evaluating averages changes nothing in training"
    assert load_file(plain / "hf" / "model.safetensors").keys() == load_file(out / "hf" / "model.safetensors").keys()
    assert all(load_file(plain / "hf" / "model.safetensors")[name].equal(tensor)
               for name, tensor in load_file(out / "hf" / "model.safetensors").items()), "the weights came back"


def test_a_resumed_run_keeps_the_same_averages(tiny_model, sft_file, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    llmtune.train("sft", recipe(tiny_model, sft_file, straight, ema_decay=0.9), checkpoint={"export_ema": True})
    llmtune.train("sft", recipe(tiny_model, sft_file, resumed, ema_decay=0.9), callbacks=[StopAt(2)])
    llmtune.train("sft", recipe(tiny_model, sft_file, resumed, ema_decay=0.9),
                  checkpoint={"export_ema": True, "resume_from_checkpoint": "auto"})
    expected, got = (load_file(folder / "hf_ema" / "model.safetensors") for folder in (straight, resumed))
    assert all(got[name].equal(value) for name, value in expected.items())
