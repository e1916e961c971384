"""The console of a one-process run: on a terminal (a pseudo-terminal here) the progress bar advances every optimizer
step with loss, lr and tokens/s after it, and the logged lines, each with the time, come out whole; on a pipe there
is no bar and the lines are plain."""

import fcntl
import os
import pty
import re
import struct
import subprocess
import termios

import pytest
import yaml

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
def runs(recipe, tmp_path_factory) -> tuple[tuple[int, str], subprocess.CompletedProcess]:
    """(the run on a terminal: run_on_terminal, the run on a pipe), side by side, each in its own output folder:
    most of a run is its start-up (importing torch, transformers, datasets), one core's work."""
    command = [str(REPO / "bin" / "llmtune"), *cli_words(["pt", recipe]),
               f"train.output_dir={tmp_path_factory.mktemp('console_pipe')}"]
    on_pipe = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    on_terminal = run_on_terminal("pt", recipe)
    stdout, stderr = on_pipe.communicate(timeout=600)
    return on_terminal, subprocess.CompletedProcess(command, on_pipe.returncode, stdout, stderr)


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
