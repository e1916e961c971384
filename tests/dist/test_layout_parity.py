"""Layout invariance through the real CLI, fp32: the demo sft recipe on a tiny GQA Llama, sft samples of
unequal lengths padded per batch, the same global batch of 4 split over ranks x micro-batch x
accumulation, 5 steps. Per-step losses and gradient norms agree to 1e-5 relative, final weights
to 1e-5 absolute. Two of the layouts are one recipe, train.global_batch_size=4 with micro-batches of 2,
run on 1 and on 2 processes (accumulation derived: 2 and 1): bitwise the same run. Also a two-"node" run:
two torchrun invocations with --nnodes 2 on 127.0.0.1. The one-process layouts run the CLI's code in this process
(llmtune.run.cli.main), where a launch of bin/llmtune would add only its start-up; the others are launched."""

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from llmtune.run.cli import main as cli_main
from tests.helpers import REPO, cli_words, free_port, read_metrics, run_cli

STEPS = 5
GLOBAL_BATCH = ["train.global_batch_size=4"]


def accumulation(steps: int) -> list[str]:
    """The demo recipe sets a global batch; these layouts give the accumulation instead."""
    return ["train.global_batch_size=null", f"--train.gradient_accumulation_steps={steps}"]


# name: (processes, micro-batch, how the step's size is given); the global batch is 4 in every layout.
LAYOUTS = {"dp1_micro1_acc4": (1, 1, accumulation(4)), "dp1_micro4_acc1": (1, 4, accumulation(1)),
           "dp2_micro1_acc2": (2, 1, accumulation(2)), "dp2_micro2_global4": (2, 2, GLOBAL_BATCH),
           "dp1_micro2_global4": (1, 2, GLOBAL_BATCH)}
REFERENCE = "dp1_micro1_acc4"


def overrides(tiny_model, sft_file, output_dir, micro, batch):
    return [f"model.name_or_path={tiny_model}", f"data.train_files={sft_file}", "data.packing=false",
            f"train.output_dir={output_dir}", f"train.max_steps={STEPS}", "train.logging_steps=1",
            "train.learning_rate=2e-3", "train.warmup_ratio=0", f"train.per_device_train_batch_size={micro}",
            "eval_generation.files=[]", *batch]


def two_node_run(args: list[str]) -> None:
    """Two torchrun agents, one process each, meeting at a c10d rendezvous on 127.0.0.1."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                                f"--node-rank={node}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                                "--rdzv-id=llmtune-test", "-m", "llmtune", *cli_words(args)],
                               cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for node in (0, 1)]
    for agent in agents:
        _, err = agent.communicate(timeout=600)
        assert agent.returncode == 0, err[-3000:]


@pytest.fixture(scope="module")
def runs(tiny_model, sft_file, tmp_path_factory):
    out = {}
    for name, (nproc, micro, batch) in LAYOUTS.items():
        output_dir = tmp_path_factory.mktemp(name)
        args = ["sft", str(REPO / "recipes" / "demo" / "sft.yaml"),
                *overrides(tiny_model, sft_file, output_dir, micro, batch), "--nproc", str(nproc)]
        if nproc == 1:
            assert cli_main(cli_words(args)) == 0, name
        else:
            result = run_cli(*args)
            assert result.returncode == 0, result.stderr[-3000:]
        out[name] = output_dir
    output_dir = tmp_path_factory.mktemp("two_nodes")
    two_node_run(["sft", "recipes/demo/sft.yaml", *overrides(tiny_model, sft_file, output_dir, 2, accumulation(1))])
    out["two_nodes"] = output_dir
    return out


@pytest.mark.parametrize("metric", ["loss", "grad_norm"])
def test_per_step_losses_and_gradient_norms_agree(runs, metric):
    """grad_norm is the global norm before clipping: it catches a wrong gradient scale, which AdamW's
    update (nearly scale-free) and the final weights would hide."""
    values = {name: [m[metric] for m in read_metrics(d)] for name, d in runs.items()}
    reference = values.pop(REFERENCE)
    assert len(reference) == STEPS
    for name, other in values.items():
        assert other == pytest.approx(reference, rel=1e-5, abs=0), name
    if metric == "loss":
        assert reference[-1] < reference[0], "the run should learn something"


def test_final_weights_agree(runs, tiny_model):
    weights = {name: load_file(d / "hf" / "model.safetensors") for name, d in runs.items()}
    reference = weights.pop(REFERENCE)
    initial = load_file(tiny_model / "model.safetensors")
    assert any(not torch.equal(reference[k], initial[k]) for k in initial), "training must change the weights"
    for name, other in weights.items():
        assert other.keys() == reference.keys()
        for key in reference:
            torch.testing.assert_close(other[key], reference[key], rtol=0, atol=1e-5,
                                       msg=lambda m: f"{name}: {key}: {m}")


def test_one_recipe_on_one_and_on_two_processes_is_bitwise_the_same_run(runs):
    """One process accumulates the two micro-batches that two processes take one each, holding the same
    samples, so their gradients are summed in the same additions; the clipping factor comes from fp64 norms."""
    one, two = runs["dp1_micro2_global4"], runs["dp2_micro2_global4"]
    assert [m["loss"] for m in read_metrics(one)] == [m["loss"] for m in read_metrics(two)]
    first, second = load_file(one / "hf" / "model.safetensors"), load_file(two / "hf" / "model.safetensors")
    assert all(torch.equal(first[key], second[key]) for key in first)
