"""train.per_device_train_batch_size: auto and train.gradient_checkpointing: auto on 2 processes, started by
`llmtune --nproc 2` (the launcher decides before the workers start and hands them its settings) and by a torchrun
the user started (rank 0 decides, both ranks learn them). On this machine's RAM every micro-batch of the tiny model
fits without checkpointing, so each takes the whole share of a rank, 16 / 2 = 8 rows with no accumulation, and no
checkpointing, says so once, records them in config.yaml, and trains the curve of test_resume's run, which writes 4
(accumulation 2), within 1e-5."""

import os
import subprocess
import sys

import pytest
import yaml

from tests.dist.test_cluster_runs import without_nproc
from tests.dist.test_resume import args
from tests.helpers import REPO, cli_words, read_metrics, run_cli

AUTO = ("train.per_device_train_batch_size=auto", "train.gradient_checkpointing=auto")


def torchrun(words: list[str]) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node 2 -m llmtune WORDS`, as a user starts it."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "llmtune",
               *cli_words(words)]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("launcher", ["--nproc", "torchrun"])
def test_auto_takes_the_largest_micro_batch_on_every_rank(straight_run, tiny_model, sft_file, tmp_path, launcher):
    words = args(tiny_model, sft_file, tmp_path, 2, *AUTO)
    result = run_cli(*words) if launcher == "--nproc" else torchrun(without_nproc(words))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("train.per_device_train_batch_size: auto -> ") == 1, result.stderr[-3000:]
    assert "train.per_device_train_batch_size: auto -> 8 (accumulation 1, global batch 16)" in result.stderr
    assert result.stderr.count("train.gradient_checkpointing: auto -> none: the least recompute") == 1
    train = yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]
    assert (train["per_device_train_batch_size"], train["gradient_checkpointing"]) == (8, "none")
    straight = [r["loss"] for r in read_metrics(straight_run[0]) if "loss" in r]
    assert [r["loss"] for r in read_metrics(tmp_path) if "loss" in r] == pytest.approx(straight, rel=1e-5)
