"""Layout invariance through the real CLI: the demo sft recipe on a tiny model, on the same global batches of
unequal-length samples, split over (1 process, accumulation 2), (2 processes, accumulation 1) and
(1 process, micro-batch 1, accumulation 8) gives the same per-step losses and final weights (fp32)."""

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import read_metrics, run_cli

STEPS = 4


@pytest.fixture(scope="module")
def runs(tiny_model, sft_file, tmp_path_factory):
    layouts = {"1proc_acc2": (1, 4, 2), "2proc_acc1": (2, 4, 1), "1proc_micro1_acc8": (1, 1, 8)}
    out = {}
    for name, (nproc, micro, accumulation) in layouts.items():
        output_dir = tmp_path_factory.mktemp(name)
        result = run_cli("sft", "recipes/demo/sft.yaml", f"model.name_or_path={tiny_model}",
                         f"data.train_files={sft_file}", f"train.output_dir={output_dir}", f"train.max_steps={STEPS}",
                         "train.logging_steps=1", "train.learning_rate=1e-2", "train.warmup_ratio=0",
                         f"train.per_device_train_batch_size={micro}",
                         f"--train.gradient_accumulation_steps={accumulation}", "--nproc", str(nproc))
        assert result.returncode == 0, result.stderr[-3000:]
        out[name] = output_dir
    return out


@pytest.mark.parametrize("metric", ["loss", "grad_norm"])
def test_per_step_losses_and_gradient_norms_agree(runs, metric):
    """grad_norm is the global norm before clipping: it catches a wrong gradient scale, which AdamW's
    update (nearly scale-free) and the final weights would hide."""
    values = {name: [m[metric] for m in read_metrics(d)] for name, d in runs.items()}
    reference = values.pop("1proc_acc2")
    assert len(reference) == STEPS
    for name, other in values.items():
        assert other == pytest.approx(reference, rel=1e-5, abs=0), name
    if metric == "loss":
        assert reference[-1] < reference[0], "the run should learn something"


def test_final_weights_agree(runs, tiny_model):
    weights = {name: load_file(d / "hf" / "model.safetensors") for name, d in runs.items()}
    reference = weights.pop("1proc_acc2")
    initial = load_file(tiny_model / "model.safetensors")
    assert any(not torch.equal(reference[k], initial[k]) for k in initial), "training must change the weights"
    for name, other in weights.items():
        assert other.keys() == reference.keys()
        for key in reference:
            torch.testing.assert_close(other[key], reference[key], rtol=0, atol=1e-5, msg=f"{name}: {key}")


def test_metrics_have_the_documented_fields(runs):
    for record in read_metrics(runs["2proc_acc1"]):
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= record.keys()
        assert record["tokens_per_s"] > 0 and record["grad_norm"] > 0
    assert [m["step"] for m in read_metrics(runs["2proc_acc1"])] == list(range(1, STEPS + 1))
