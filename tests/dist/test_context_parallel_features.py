"""Every other feature keeps working with cp > 1: a cp=2 checkpoint resumes on cp=1 and a cp=1 checkpoint on cp=2
on the same curve (1e-5), with gradient accumulation, validation, evaluation by generation (the cp peers generate
their own prompts with the model's own attention) and export. The cp=1 runs go through the CLI's code
in pytest's process, the two cp=2 runs train in one launch of 2 processes (most of a launch is its start-up:
importing torch, transformers, datasets)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.dist.test_resume import run_here
from tests.helpers import REPO, launch_cases, read_metrics

RECIPE = str(REPO / "recipes" / "demo" / "sft.yaml")
RESUMED_FROM = "checkpoints/global_step_2"


def overrides(tiny_model, sft_file, output_dir, cp) -> list[str]:
    return [f"model.name_or_path={tiny_model}", f"data.train_files={sft_file}", f"train.output_dir={output_dir}",
            "train.max_steps=4", "train.logging_steps=1", "train.per_device_train_batch_size=2",
            "train.global_batch_size=4", "train.learning_rate=2e-3", "data.val_ratio=0.2", "train.eval_steps=2",
            "checkpoint.save_steps=2", "checkpoint.export_dtype=fp32", f"parallel.cp_size={cp}",
            f"eval_generation.files={sft_file}", "eval_generation.max_samples=3", "eval_generation.max_new_tokens=5",
            "eval_generation.answer_column=response", "eval_generation.do_sample=true",
            "eval_generation.temperature=1.5"]


def copy_to_resume(run, folder) -> None:
    """The run's folder as its step-4 end left it, its export removed, for a run resumed from its step 2."""
    shutil.copytree(run, folder)
    shutil.rmtree(folder / "hf")


@pytest.fixture(scope="module")
def runs(tiny_model, sft_file, tmp_path_factory):
    """cpN: a run on cp=N; cpN_resumed: a copy of it resumed on the other layout from its step-2 checkpoint."""
    root = tmp_path_factory.mktemp("cp_features")
    out = {name: root / name for name in ("cp1", "cp2", "cp1_resumed", "cp2_resumed")}
    run_here("sft", RECIPE, *overrides(tiny_model, sft_file, out["cp1"], 1))
    copy_to_resume(out["cp1"], out["cp1_resumed"])
    resume = f"checkpoint.resume_from_checkpoint={out['cp1_resumed'] / RESUMED_FROM}"
    launch_cases([{"recipe": RECIPE, "overrides": overrides(tiny_model, sft_file, out["cp2"], 2)},
                  {"recipe": RECIPE, "overrides": [*overrides(tiny_model, sft_file, out["cp1_resumed"], 2), resume]}],
                 root)
    copy_to_resume(out["cp2"], out["cp2_resumed"])
    run_here("sft", RECIPE, *overrides(tiny_model, sft_file, out["cp2_resumed"], 1),
             "--resume_from_checkpoint", str(out["cp2_resumed"] / RESUMED_FROM))
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


def test_cp_peers_sample_the_completions_of_cp1(runs):
    def sampled(run):
        return [(row["step"], row["completion_ids"])
                for row in map(json.loads, (runs[run] / "generations.jsonl").read_text().splitlines())]

    assert [step for step, _ in sampled("cp1")] == [2, 2, 2, 4, 4, 4]
    for run in ("cp2", "cp1_resumed", "cp2_resumed"):
        assert sampled(run) == sampled("cp1"), run
