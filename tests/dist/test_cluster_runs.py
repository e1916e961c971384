"""The life of a job on a cluster (2 processes, fp32), each against an uninterrupted run of the same recipe, bitwise:
- a stop signal on one rank: every rank saves at the same step and the job exits 75 with the command that resumes,
  a second signal during the save changing nothing; the resumed run continues the exact curve;
- a crash on one rank under `torchrun --max-restarts 1` with checkpoint.resume_from_checkpoint=auto: the restarted
  workers resume and end with the same weights.
Damaged checkpoints and a full disk are tests/dist/test_damaged_checkpoints.py's (a file of their own, so that each
file's launches take under two minutes); the checks that need no processes (the manifest's contents, every checkpoint
damaged, export --verify) are in tests/e2e/test_checkpoints.py."""

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.dist.test_resume import STEPS, args, wait_for
from tests.helpers import REPO, cli_words, descendants, read_metrics, run_cli

RESUME = "checkpoint.resume_from_checkpoint=auto"


def torchrun(faults: str, recipe_args: list[str], *torchrun_options: str) -> subprocess.CompletedProcess:
    """tests/dist/fault_worker.py on 2 processes; recipe_args: llmtune's arguments without --nproc (made a command
    line as the tests give bin/llmtune: cli_words, no plots)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               *torchrun_options, str(REPO / "tests" / "dist" / "fault_worker.py"), faults, *cli_words(recipe_args)]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def without_nproc(argv: list[str]) -> list[str]:
    at = argv.index("--nproc")
    return argv[:at] + argv[at + 2:]


def worker_pids(process: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of the llmtune workers below `process`."""
    found = {}
    for pid in descendants(process.pid):
        try:
            environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0")
                           if "=" in item)
        except OSError:
            continue
        if "RANK" in environ:
            found[int(environ["RANK"])] = pid
    return found


def preempted_run(tiny_model, sft_file, output_dir) -> dict:
    """SIGTERM to rank 1 once step 3 is logged; SIGTERM and SIGINT to both ranks again while the save is written."""
    command = [str(REPO / "bin" / "llmtune"), *cli_words(args(tiny_model, sft_file, output_dir, 2))]
    process = subprocess.Popen(command, cwd=REPO,
                               env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (output_dir / "metrics.jsonl").is_file() and 3 in [m["step"] for m in read_metrics(output_dir)],
             process)
    pids = worker_pids(process)
    os.kill(pids[1], signal.SIGTERM)
    saving = output_dir / "checkpoints"
    deadline = time.monotonic() + 120
    while not any(p.name.endswith(".partial") for p in saving.glob(".global_step_*")) and process.poll() is None:
        assert time.monotonic() < deadline, "no save began after the signal"
        time.sleep(0.001)
    second_during_save = process.poll() is None
    for pid in pids.values():
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                second_during_save = False
    stderr = process.communicate(timeout=300)[1]
    return {"code": process.returncode, "stderr": stderr, "second_during_save": second_during_save}


@pytest.fixture(scope="module")
def runs(straight_run, tiny_model, sft_file, tmp_path_factory):
    out = {}
    out["straight"], out["straight_result"] = straight_run

    preempted = tmp_path_factory.mktemp("preempted")
    out["preempted"] = preempted_run(tiny_model, sft_file, preempted)
    out["preempted_latest"] = (preempted / "checkpoints" / "latest").read_text()
    out["preempted_metrics"] = [m["step"] for m in read_metrics(preempted)]

    # The two launches below are not signalled at a chosen moment: they run side by side.
    with ThreadPoolExecutor(1) as background:
        restarted = tmp_path_factory.mktemp("restarted")
        restart = background.submit(torchrun, "crash@5", without_nproc(args(tiny_model, sft_file, restarted, 2, RESUME)),
                                    "--max-restarts", "1")
        resumed = run_cli(*args(tiny_model, sft_file, preempted, 2, RESUME))
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        out["preempted_resumed"] = preempted
        out["restarted_result"], out["restarted"] = restart.result(), restarted
    return out


def losses(output_dir):
    return [m["loss"] for m in read_metrics(output_dir)]


def assert_same_run(output_dir, straight):
    assert [m["step"] for m in read_metrics(output_dir)] == list(range(1, STEPS + 1))
    assert losses(output_dir) == losses(straight)
    reference = load_file(straight / "hf" / "model.safetensors")
    trained = load_file(output_dir / "hf" / "model.safetensors")
    assert trained.keys() == reference.keys()
    assert all(torch.equal(reference[k], v) for k, v in trained.items())


def test_a_signal_on_one_rank_saves_on_every_rank_and_exits_75(runs):
    preempted = runs["preempted"]
    assert preempted["code"] == 75, preempted["stderr"][-3000:]
    assert preempted["second_during_save"], "the second signals were sent while the save was written"
    stopped = [line for line in preempted["stderr"].splitlines() if line.startswith("llmtune: stopped by SIGTERM")]
    assert len(stopped) == 1, preempted["stderr"][-3000:]
    step = runs["preempted_metrics"][-1]
    assert 3 <= step < STEPS
    assert runs["preempted_latest"] == f"global_step_{step}"
    assert f"saved {runs['preempted_resumed'] / 'checkpoints' / f'global_step_{step}'}" in stopped[0]
    assert stopped[0].endswith(f"{RESUME} --nproc 2")
    assert_same_run(runs["preempted_resumed"], runs["straight"])


def test_a_crashed_rank_restarted_by_torchrun_resumes_on_the_same_curve(runs):
    result = runs["restarted_result"]
    assert result.returncode == 0, result.stderr[-3000:]
    # the crash happened, after step 4's checkpoint, and the restart resumed from it
    assert "resumed from" in result.stderr and "global_step_4" in result.stderr, result.stderr[-3000:]
    assert_same_run(runs["restarted"], runs["straight"])


def test_every_run_ends_with_a_summary_on_rank_0(runs):
    straight = runs["straight"]
    summaries = [line for line in runs["straight_result"].stderr.splitlines() if "run finished at step" in line]
    assert len(summaries) == 1, runs["straight_result"].stderr[-3000:]
    last = read_metrics(straight)[-1]
    tokens = sum(m["input_tokens"] for m in read_metrics(straight))
    assert f"run finished at step {STEPS} of {STEPS}: {tokens:,} tokens" in summaries[0]
    assert f"last logged loss {last['loss']:.4f}" in summaries[0]
    assert f"newest checkpoint {straight / 'checkpoints' / f'global_step_{STEPS}'}" in summaries[0]
    assert f"llmtune export {straight / 'checkpoints' / f'global_step_{STEPS}'} OUT_DIR" in summaries[0]
    assert f"exported to {straight / 'hf'} (fp32 weights: checkpoint.export_dtype)" in summaries[0]
    stopped = [line for line in runs["preempted"]["stderr"].splitlines() if "run stopped by a signal at step" in line]
    assert len(stopped) == 1 and f"{RESUME} --nproc 2" in stopped[0]
