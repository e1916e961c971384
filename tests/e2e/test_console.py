"""The console of a one-process run: on a terminal (a pseudo-terminal here) the progress bar advances every optimizer
step with loss, lr and tokens/s after it, and the logged lines, each with the time, come out whole; on a pipe there
is no bar and the lines are plain. output_dir/train.log holds the lines the console showed, the bar's drawings left
out, and the start banner says the run's own numbers."""

import fcntl
import os
import pty
import re
import struct
import subprocess
import termios
from pathlib import Path

import pytest
import yaml
from transformers import AutoConfig, AutoModelForCausalLM

from llmtune.run.cli import main as cli_main
from tests.helpers import REPO, cli_words

STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
STEPS = 6


pytestmark = pytest.mark.slow  # the runs these tests read are processes of their own


@pytest.fixture(scope="module")
def recipe(assets, tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("console")
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"config": str(assets / "model"), "tokenizer": str(assets / "tokenizer")},
        "data": {"train_files": [str(assets / "data" / "pt.jsonl")], "max_seq_len": 64},
        "train": {"output_dir": str(root / "out"), "max_steps": STEPS, "per_device_train_batch_size": 2,
                  "logging_steps": 3},
        "checkpoint": {"export_hf": False},
    }))
    return str(path)


def run_on_terminal(*args: str) -> tuple[int, str]:
    """`bin/llmtune ARGS` (no plots: cli_words) with stdout and stderr on a pseudo-terminal: its exit code and all
    it wrote."""
    pid, terminal = pty.fork()
    if pid == 0:
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))  # a terminal's size: 40 x 200
        os.execv(str(REPO / "bin" / "llmtune"), ["llmtune", *cli_words(args)])
    chunks = []
    while True:
        try:
            chunk = os.read(terminal, 65536)
        except OSError:  # the child is gone: EIO on Linux
            break
        if not chunk:
            break
        chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), b"".join(chunks).decode(errors="replace")


@pytest.fixture(scope="module")
def runs(recipe, tmp_path_factory) -> tuple[tuple[int, str], subprocess.CompletedProcess, Path]:
    """(the run on a terminal: run_on_terminal, the run on a pipe, the pipe run's output_dir), side by side, each in
    its own output folder: most of a run is its start-up (importing torch, transformers, datasets), one core's
    work."""
    pipe_dir = tmp_path_factory.mktemp("console_pipe")
    command = [str(REPO / "bin" / "llmtune"), *cli_words(["pt", recipe]), f"train.output_dir={pipe_dir}"]
    on_pipe = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    on_terminal = run_on_terminal("pt", recipe)
    stdout, stderr = on_pipe.communicate(timeout=600)
    return on_terminal, subprocess.CompletedProcess(command, on_pipe.returncode, stdout, stderr), pipe_dir


def test_on_a_terminal_the_bar_moves_every_step_and_lines_stay_whole(runs):
    code, output = runs[0]
    assert code == 0, output[-3000:]
    # The bar redraws itself after a carriage return; each drawing shows the step count and the step's figures.
    parts = [part for line in output.split("\n") for part in line.split("\r")]
    drawings = [part for part in parts if part.startswith("train: ")]
    for step in range(1, STEPS + 1):
        drawn = [d for d in drawings if f" {step}/{STEPS} [" in d]
        assert drawn, f"no drawing of step {step}: {drawings}"
        assert re.search(r"loss=\d+\.\d{4}, lr=\d\.\d\de[-+]\d\d, tokens_per_s=\d+\]$", drawn[-1]), drawn[-1]
    # The logged lines, time first, each whole (the bar is cleared before them and drawn again after).
    for step in (3, 6):
        assert any(re.fullmatch(fr"{STAMP} step {step}/{STEPS} epoch \d+\.\d\d loss \S+ .* skipped 0", part)
                   for part in parts), (step, parts)
    assert any(re.match(fr"{STAMP} INFO llmtune: run finished", part) for part in parts), parts


def test_on_a_pipe_there_is_no_bar_and_the_lines_are_plain(runs):
    result = runs[1]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "\r" not in result.stdout + result.stderr and "train: " not in result.stderr
    steps = [line for line in result.stdout.splitlines() if " step " in line]
    assert len(steps) == 2 and all(re.fullmatch(fr"{STAMP} step [36]/{STEPS} epoch .* skipped 0", s) for s in steps)
    assert all(re.match(STAMP, line) for line in result.stderr.splitlines() if " llmtune" in line)


def test_train_log_holds_the_lines_the_console_showed(runs):
    result, output_dir = runs[1], runs[2]
    assert result.returncode == 0, result.stderr[-3000:]
    logged = (output_dir / "train.log").read_text().splitlines()
    shown = result.stdout.splitlines()  # the monitor's lines
    records = [line for line in result.stderr.splitlines() if re.match(fr"{STAMP} [A-Z]+ ", line)]  # logging's
    assert shown and records
    # Each stream's lines in their order, and nothing else (datasets' progress bars on stderr are no lines).
    assert [line for line in logged if line in shown] == shown
    assert [line for line in logged if line not in shown] == records


def test_on_a_terminal_train_log_leaves_out_the_bar(runs, recipe):
    assert runs[0][0] == 0, runs[0][1][-3000:]
    logged = (Path(recipe).parent / "out" / "train.log").read_text()
    assert "\r" not in logged and "train: " not in logged
    assert [int(step) for step in re.findall(fr"(?m)^{STAMP} step (\d+)/{STEPS} ", logged)] == [3, 6]
    assert re.search(fr"(?m)^{STAMP} INFO llmtune: run finished", logged)


def test_the_start_banner_says_the_runs_numbers(runs, recipe, assets, capsys):
    result = runs[1]
    banner = dict(re.findall(fr"(?m)^{STAMP} INFO llmtune: start: (\S+) (.*)$", result.stderr))
    rows = int(re.search(r"data: (\d+) rows of up to 64 tokens", result.stderr).group(1))
    # micro-batch 2, one rank, no accumulation: 2 samples a step, rows // 2 steps an epoch; 6 steps in all.
    assert banner[f"{rows:,}"] == f"samples, {STEPS / (rows // 2):.3g} epochs of {rows // 2} steps = {STEPS} " \
                                  "optimizer steps"
    assert banner["global"] == "batch 2 samples = micro-batch 2 x accumulation 1 x 1 data-parallel"
    assert banner["layout"] == "1 rank(s) = replicate 1 x shard 1 x cp 1; every parameter sharded over 1 rank(s)"
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(assets / "model"))
    count = sum(p.numel() for p in model.parameters())
    decay = sum(p.numel() for p in model.parameters() if p.ndim >= 2)
    assert banner["parameters"] == f"{count:,}, trainable {count:,} (weight decay: {decay:,} in " \
                                   f"{sum(p.ndim >= 2 for p in model.parameters())} tensors; no decay: " \
                                   f"{count - decay:,} in {sum(p.ndim < 2 for p in model.parameters())})"
    # auto on a CPU: transformers' sdpa, wrapped by the packed documents' attention (pt packs rows of documents).
    assert banner["precision"] == "fp32, attention sdpa (through llmtune_documents), activation checkpointing none"
    # The peak `llmtune plan` prints for the same recipe and layout.
    assert cli_main(["plan", recipe, "--task", "pt"]) == 0
    peak = re.search(r"peak of a training step +(.+)$", capsys.readouterr().out, re.M).group(1)
    assert banner["planned"] == f"peak memory {peak} per rank (llmtune plan's estimate for this layout)"
