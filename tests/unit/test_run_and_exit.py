"""process_exit.run_and_exit ends a process as the interpreter would, short of its finalization: main()'s exit code
(an exception: its traceback and 1), the threads that are not daemons joined and the exit handlers run first."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

PROGRAM = """
import atexit, sys, threading, time
from llmtune.run.process_exit import run_and_exit

def main():
    atexit.register(lambda: print("exit handler ran", flush=True))
    threading.Thread(target=lambda: (time.sleep(0.5), print("thread finished", flush=True))).start()
    {body}

run_and_exit(main)
"""


def run(body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROGRAM.format(body=body)], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("body, code", [("return 3", 3), ("return None", 0), ("sys.exit(4)", 4)])
def test_the_exit_code_is_mains_after_the_threads_and_the_exit_handlers(body, code):
    result = run(body)
    assert result.returncode == code, result.stderr
    assert result.stdout.splitlines() == ["thread finished", "exit handler ran"]


def test_an_uncaught_exception_prints_its_traceback_and_exits_1():
    result = run("raise ValueError('broken recipe')")
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "ValueError: broken recipe" in result.stderr
    assert result.stdout.splitlines() == ["thread finished", "exit handler ran"]


def test_a_message_given_to_sys_exit_is_printed_and_exits_1():
    result = run("sys.exit('stopped: disk full')")
    assert (result.returncode, result.stderr.strip()) == (1, "stopped: disk full")


WORKERS_PROGRAM = """
import multiprocessing, sys
from torch.utils.data import DataLoader
from llmtune.run.process_exit import run_and_exit

def main():
    global batches  # still open at the exit, as after a run stopped by an error mid-epoch
    batches = iter(DataLoader(range(100), num_workers=2))
    next(batches)
    with open(sys.argv[1], "w") as f:
        f.write(" ".join(str(p.pid) for p in multiprocessing.active_children()))

run_and_exit(main)
"""


def test_dataloader_workers_end_with_the_process(tmp_path):
    """The exit handlers that run_and_exit runs include multiprocessing's, which terminates the daemonic children
    that DataLoader's workers are: os._exit alone would leave them to DataLoader's watchdog for 5 to 10 seconds.
    The output goes to files: a worker would hold a pipe open and the wait for its end would hide it."""
    pids, log = tmp_path / "pids", tmp_path / "stderr"
    with log.open("w") as stderr:
        done = subprocess.run([sys.executable, "-c", WORKERS_PROGRAM, str(pids)], cwd=REPO, stdout=stderr,
                              stderr=stderr, timeout=60)
    assert done.returncode == 0, log.read_text()
    workers = [int(pid) for pid in pids.read_text().split()]
    assert len(workers) == 2
    assert [pid for pid in workers if Path(f"/proc/{pid}").exists()] == []


EXECUTOR_PROGRAM = """
from concurrent.futures import ThreadPoolExecutor
from llmtune.run.process_exit import run_and_exit

def main():
    global pool  # left open, as torch.compile's and other libraries' executors are
    pool = ThreadPoolExecutor(max_workers=2)
    pool.submit(print, "task ran", flush=True).result()

run_and_exit(main)
"""


def test_an_executor_left_open_ends_with_the_process():
    """concurrent.futures' workers wait for work until its threading exit hook tells them to stop: the interpreter
    runs those hooks before it joins the threads, and so must run_and_exit, or the join waits forever."""
    done = subprocess.run([sys.executable, "-c", EXECUTOR_PROGRAM], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stdout) == (0, "task ran\n"), done.stderr
