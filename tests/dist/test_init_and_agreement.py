"""2 processes, one launch (init_and_agreement_worker.py), against one-process builds in this process:
- ranks that read different recipes (rank 1 another train.learning_rate) both stop with the same message naming the
  key, before the first step, and nothing hangs;
- a lenient load (model.strict_load false) gives the tensors it initialises the same values on 2 ranks as on 1;
- model.init_from takes a checkpoint saved on 1 rank into a 2-rank run, and one saved on 2 ranks (test_resume's
  straight run) into a 1-rank run: the weights are the checkpoint's, as its fp32 export holds them."""

import json
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from llmtune.config import load_config
from llmtune.run.cli import main as cli_main
from llmtune.run.parallel import ParallelState
from llmtune.run.worker import build_trainer
from tests.helpers import REPO, cli_words, misfit_copy


def one_rank_parameters(recipe: str, overrides: list[str]) -> dict[str, torch.Tensor]:
    state = ParallelState.initialize()
    try:
        trainer, _ = build_trainer(load_config(recipe, overrides, "sft", world_size=1), state)
        return {name: param.full_tensor() for name, param in trainer.model.hf_model.named_parameters()}
    finally:
        state.close()


@pytest.fixture(scope="module")
def launch(tiny_model, sft_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("init_and_agreement")
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(tiny_model)},
        "data": {"train_files": [str(sft_file)], "chat_template": "basic", "max_seq_len": 64},
        "train": {"output_dir": str(root / "one"), "max_steps": 2, "per_device_train_batch_size": 2,
                  "learning_rate": 1e-3},
        "checkpoint": {"save_steps": 2, "export_dtype": "fp32"},
        "monitor": {"console": False},
    }))
    assert cli_main(cli_words(["sft", str(recipe)])) == 0  # the checkpoint saved on one rank, and its export
    misfit_copy(tiny_model, root / "misfit")
    spec = {"recipe": str(recipe), "out": str(root),
            "disagree": [f"train.output_dir={root / 'disagree'}"],
            "lenient": [f"model.name_or_path={root / 'misfit'}", "model.strict_load=false",
                        f"train.output_dir={root / 'lenient'}"],
            "init_from": [f"model.init_from={root / 'one' / 'checkpoints' / 'global_step_2'}",
                          f"train.output_dir={root / 'init_from'}"]}
    (root / "spec.json").write_text(json.dumps(spec))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             str(REPO / "tests" / "dist" / "init_and_agreement_worker.py"), str(root / "spec.json")],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return root, spec


def test_ranks_with_different_recipes_stop_naming_the_key(launch):
    root, _ = launch
    expected = ("train.learning_rate differs between ranks: rank 1 has another value than rank 0 (check that every "
                "node reads the same recipe)")
    assert [(root / f"disagree_rank{rank}.txt").read_text() for rank in (0, 1)] == [expected, expected]
    assert not (root / "disagree" / "metrics.jsonl").exists(), "stopped before the first step"


def test_a_lenient_load_initialises_the_same_values_on_two_ranks_as_on_one(launch):
    root, spec = launch
    two = torch.load(root / "lenient.pt", weights_only=True)
    one = one_rank_parameters(spec["recipe"], [*spec["lenient"], f"train.output_dir={root / 'lenient_one'}"])
    assert two.keys() == one.keys()
    for name in two:
        assert torch.equal(two[name], one[name]), name


def test_init_from_a_one_rank_checkpoint_on_two_ranks(launch):
    root, _ = launch
    params = torch.load(root / "init_from.pt", weights_only=True)
    exported = load_file(root / "one" / "hf" / "model.safetensors")
    assert params.keys() == exported.keys()
    for name, value in params.items():
        assert torch.equal(value, exported[name]), name


def test_init_from_a_two_rank_checkpoint_on_one_rank(launch, straight_run):
    root, spec = launch
    straight = straight_run[0]
    params = one_rank_parameters(spec["recipe"], [f"model.init_from={straight / 'checkpoints' / 'global_step_8'}",
                                                  f"train.output_dir={root / 'from_two'}"])
    exported = load_file(straight / "hf" / "model.safetensors")
    assert params.keys() == exported.keys()
    for name, value in params.items():
        assert torch.equal(value, exported[name]), name
