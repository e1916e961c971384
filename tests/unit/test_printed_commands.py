"""The commands llmtune's messages print start as the user started llmtune and run as printed: the resume command
turns off a train.overwrite_output_dir that would refuse to go on, and keeps the launch (--nproc N, a single-node
torchrun)."""

import pytest

from llmtune.command import PROG, command_line
from llmtune.run.cli import resume_command
from llmtune.run.launch import LOCAL_NPROC

TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", LOCAL_NPROC, PROG)


@pytest.fixture(autouse=True)
def plain_process(monkeypatch):
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)


def test_a_command_starts_as_the_user_started_llmtune_and_quotes_its_words(monkeypatch):
    assert command_line("plot", "runs/my run") == "llmtune plot 'runs/my run'"
    monkeypatch.setenv(PROG, "bin/llmtune")
    assert command_line("export", "ckpt", "OUT_DIR") == "bin/llmtune export ckpt OUT_DIR"


@pytest.mark.parametrize("overrides, overwrites, tail", [
    (["train.max_steps=4"], False, "train.max_steps=4 checkpoint.resume_from_checkpoint=auto"),
    (["train.overwrite_output_dir=true", "checkpoint.resume_from_checkpoint=latest"], True,
     "train.overwrite_output_dir=false checkpoint.resume_from_checkpoint=auto"),
    ([], True, "train.overwrite_output_dir=false checkpoint.resume_from_checkpoint=auto"),  # set by the recipe
])
def test_the_resume_command_goes_on_from_the_checkpoints(overrides, overwrites, tail):
    assert resume_command("sft", "r.yaml", overrides, overwrites) == f"llmtune sft r.yaml {tail}"


def test_the_resume_command_keeps_the_launch(monkeypatch):
    monkeypatch.setenv(LOCAL_NPROC, "2")
    assert resume_command("pt", "r.yaml", [], False) == "llmtune pt r.yaml checkpoint.resume_from_checkpoint=auto " \
                                                        "--nproc 2"
    monkeypatch.delenv(LOCAL_NPROC)
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "4"), ("LOCAL_WORLD_SIZE", "4"), ("GROUP_WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)
    assert resume_command("pt", "r.yaml", [], False) == ("torchrun --standalone --nproc-per-node=4 -m llmtune pt "
                                                         "r.yaml checkpoint.resume_from_checkpoint=auto")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")  # several nodes: their rendezvous options are the user's
    assert resume_command("pt", "r.yaml", [], False) == ("on every node, the launch that started this run, with: -m "
                                                         "llmtune pt r.yaml checkpoint.resume_from_checkpoint=auto")
