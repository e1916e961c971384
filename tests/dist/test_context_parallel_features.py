"""Every other feature keeps working with cp > 1, through the real CLI: a cp=2 checkpoint resumes on cp=1 and
a cp=1 checkpoint on cp=2 on the same curve (1e-5), with gradient accumulation, validation and export."""

import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.helpers import read_metrics, run_cli


def args(tiny_model, sft_file, output_dir, cp, *extra):
    return ["sft", "recipes/demo/sft.yaml", f"model.name_or_path={tiny_model}", f"data.train_files={sft_file}",
            f"train.output_dir={output_dir}", "train.max_steps=4", "train.logging_steps=1",
            "train.per_device_train_batch_size=2", "train.global_batch_size=4", "train.learning_rate=2e-3",
            "data.val_ratio=0.2", "train.eval_steps=2", "checkpoint.save_steps=2", "checkpoint.export_dtype=fp32",
            f"parallel.cp_size={cp}", "--nproc", str(cp), *extra]


@pytest.fixture(scope="module")
def runs(tiny_model, sft_file, tmp_path_factory):
    """cpN: a run on cp=N; cpN_resumed: a copy of it resumed on the other layout from its step-2 checkpoint."""
    out = {}
    for cp in (1, 2):
        out[f"cp{cp}"] = tmp_path_factory.mktemp(f"cp{cp}")
        out[f"cp{cp}_resumed"] = tmp_path_factory.mktemp(f"cp{cp}_resumed_on_cp{3 - cp}") / "run"

    def train(cp, output_dir, *extra):
        result = run_cli(*args(tiny_model, sft_file, output_dir, cp, *extra))
        assert result.returncode == 0, result.stderr[-3000:]

    def straight(cp):
        train(cp, out[f"cp{cp}"])

    def resumed(cp):
        folder = out[f"cp{cp}_resumed"]
        shutil.copytree(out[f"cp{cp}"], folder)
        shutil.rmtree(folder / "hf")
        train(3 - cp, folder, "--resume_from_checkpoint", str(folder / "checkpoints" / "global_step_2"))

    # The cp=1 and cp=2 runs of each stage side by side: most of a run is its start-up (importing torch,
    # transformers, datasets), one core's work.
    with ThreadPoolExecutor() as pool:
        for stage in (straight, resumed):
            list(pool.map(stage, (1, 2)))  # list(): waits for both and raises a failed run's error
    return out


@pytest.mark.parametrize("cp", [1, 2])
def test_checkpoint_resumes_on_the_other_layout(runs, cp):
    straight, resumed = read_metrics(runs[f"cp{cp}"]), read_metrics(runs[f"cp{cp}_resumed"])
    for metric in ("loss", "eval_loss"):
        expected = [m.get(metric) for m in straight]
        got = [m.get(metric) for m in resumed]
        assert [g is None for g in got] == [e is None for e in expected]
        assert [g for g in got if g is not None] == pytest.approx([e for e in expected if e is not None], rel=1e-5)
    reference = load_file(runs[f"cp{cp}"] / "hf" / "model.safetensors")
    for key, value in load_file(runs[f"cp{cp}_resumed"] / "hf" / "model.safetensors").items():
        torch.testing.assert_close(value, reference[key], rtol=0, atol=1e-5)


def test_cp2_and_cp1_runs_agree_and_export_loads(runs):
    cp1, cp2 = read_metrics(runs["cp1"]), read_metrics(runs["cp2"])
    assert [m["loss"] for m in cp2] == pytest.approx([m["loss"] for m in cp1], rel=1e-5)
    assert [m.get("eval_loss") for m in cp2 if "eval_loss" in m] == \
        pytest.approx([m["eval_loss"] for m in cp1 if "eval_loss" in m], rel=1e-5)
    model = AutoModelForCausalLM.from_pretrained(runs["cp2"] / "hf")
    assert model.config._attn_implementation != "llmtune_ulysses"
