"""The GPU proof: llmtune's CUDA paths run once each on one GPU, its speed beside a plain FSDP2 loop and where the
time of both goes, its memory beside `llmtune plan`, in one command of under 8 minutes that writes its report as it
goes.

    python benchmarks/device/proof.py [--out DIR] [--dry-run] [--budget-scale X] [--only STAGES]

The stages run in STAGES' order (what matters most first), each a process of its own with a time budget (STAGES'
seconds times --budget-scale; --help lists them). A stage that crashes or runs out of time keeps the items it
finished and the next stage starts; one that crashes inside an item starts again after it.
  env      a. the machine: GPU, driver, Python, torch, CUDA, NCCL and package versions, the wheels on PYTHONPATH
  tests    b. the suite's CUDA tests (marked cuda, skipped on a CPU): pytest's outcome and reason for each
  runs     b. one-process runs of tiny models through llmtune.train, on their CUDA paths: pt and sft with each
              attention backend on packed rows of skewed lengths, beside sdpa's losses; dpo, LoRA, QLoRA, a mixture
              of experts, Liger, pinned offload, auto micro-batch, a resume compared bitwise, the export's logits,
              float8, torch.compile (benchmarks/device/runs.py)
  profile  c. torch.profiler over 3 steps of llmtune and of the plain loop on the speed stage's shape: the CUDA
              kernel time of each by category, the GPU's idle time between kernels and the launches per step, side
              by side (benchmarks/device/profiling.py), and llmtune's middle step as a Chrome trace
  speed    c. the Llama-3.2-1B shape at seq 8192, bf16 with activation checkpointing: llmtune (benchmarks/gpu.py's
              run) beside benchmarks/plain_fsdp_loop.py on the same model and tokens
  memory   d. the chunked loss against full logits and Liger's fused linear cross-entropy, T=8192, V=151,936
              (benchmarks/chunk_loss.py)
  extra    c. the speed stage's run with torch.compile, then with float8 tensorwise too (a GPU of sm_89 or later);
              torchtitan's llama3 trainer on the same shape and corpus, where torchtitan is installed, eager and
              compiled; both compiled with selective activation checkpointing; llmtune compiled with checkpointing
              auto; llmtune compiled with float8 rowwise
Every run of the runs, speed and extra stages also gives d: `llmtune plan`'s peak for its recipe beside the run's
torch.cuda.max_memory_allocated.

OUT (default device_proof/) holds device_proof.md (one table per part, a to d), device_proof.json (the same, for
tools), both rewritten after every stage, device_proof.log (every stage's output, one after another) and
llmtune_step.pt.trace.json (the profile's trace, under 16 MiB): four files, where a lent GPU machine hands back eight
at most. The runs are made in a temporary folder, removed at the end. Each stage prints one line as it
ends. The exit status is 0 whatever the stages found: not 0 only when this script itself is broken.

--dry-run: every stage on this machine's CPU with tiny shapes; what needs CUDA is reported skipped ("no CUDA"),
never passed. tests/unit/test_device_proof.py runs it, so that the proof keeps working between lent GPUs.

On a GPU machine without network, the missing packages carried as wheels:
    pip install --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:$PWD
    python benchmarks/device/proof.py --out proof
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):
    # Run as a file, its folder heads sys.path, where its modules (items.py, runs.py, ...) would stand in for any
    # package of the same name: the repository takes its place, as under python -m benchmarks.device.proof.
    sys.path[0] = str(REPO)

from benchmarks.device.items import CONTEXT_LOST, Results, interrupted, read_events  # noqa: E402
from benchmarks.device.report import stage_line, write_reports  # noqa: E402


@dataclass(frozen=True)
class Stage:
    name: str
    part: str  # the report's part: a, b, c or d
    budget_s: float
    what: str


# 480 s in all: docs/gpu.md says which stages gave the profile its 70 s.
STAGES = (
    Stage("env", "a", 10, "the machine and its packages"),
    Stage("tests", "b", 30, "the suite's CUDA tests (pytest -m cuda)"),
    Stage("runs", "b", 110, "one-process runs of tiny models on their CUDA paths"),
    Stage("profile", "c", 70, "torch.profiler over 3 steps of llmtune and the plain loop, the speed stage's shape"),
    Stage("speed", "c", 90, "Llama-3.2-1B shape, seq 8192, bf16 + activation checkpointing, beside the plain loop"),
    Stage("memory", "d", 40, "the chunked loss against full logits and Liger's fused loss"),
    Stage("extra", "c", 130, "the speed run with torch.compile, then float8 tensorwise too; torchtitan where "
                             "installed, eager and compiled; selective checkpointing on both; llmtune's auto; float8 "
                             "rowwise"),
)
LOG = "device_proof.log"


def run_stage(stage: Stage, command: list[str], budget: float, work: Path, log_path: Path) -> dict:
    """The stage's process (`command`), started again after a crash inside an item while `budget` seconds last, its
    output added to `log_path`; its section of the report."""
    from tests.helpers import kill_tree

    deadline = time.monotonic() + budget
    path = work / f"{stage.name}.jsonl"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log_path.open("a") as log:
        log.write(f"[device_proof] stage {stage.name}: {stage.what}\n")
        log.flush()
        while True:
            process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                code = process.wait(timeout=max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                kill_tree(process)
                outcome = "timed out"
                break
            if code == 0:
                outcome = "completed"
                break
            crashed = interrupted(read_events(path))
            if crashed is None and code != CONTEXT_LOST:
                outcome = f"crashed (exit {code})"
                break
            if crashed is not None:
                Results(path).write("ended", {"name": crashed, "status": "failed", "reason": f"the stage's process "
                                              f"ended (exit {code}) during it; see {log_path.name}"})
            where = crashed or "an item that left CUDA unusable"
            log.write(f"\n[device_proof] {stage.name}: its process ended (exit {code}) in {where}; started again\n")
            log.flush()
    seconds = budget - max(deadline - time.monotonic(), 0)
    return section(stage, outcome, seconds, budget, read_events(path))


def section(stage: Stage, outcome: str, seconds: float, budget: float, events: list[dict]) -> dict:
    """The stage's part of the report: its outcome, its time, every item that ended and the one its time ran out in."""
    rows = [{k: v for k, v in e.items() if k != "event"} for e in events if e["event"] == "ended"]
    cut = interrupted(events)
    if cut is not None:
        rows.append({"name": cut, "status": "timed out", "reason": f"the stage {outcome} during it"})
    return {"part": stage.part, "what": stage.what, "outcome": outcome, "seconds": round(seconds, 1),
            "budget_s": round(budget), "counts": dict(Counter(row["status"] for row in rows)), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "),
                                     epilog="stages, in order, with their budgets: " + ", ".join(
                                         f"{s.name} ({s.budget_s:g} s: {s.what})" for s in STAGES))
    parser.add_argument("--out", default="device_proof", help="folder of the reports, the log and the "
                        "trace; default %(default)s")
    parser.add_argument("--dry-run", action="store_true", help="every stage on the CPU with tiny shapes; what "
                        "needs CUDA reported skipped (no CUDA)")
    parser.add_argument("--budget-scale", type=float, default=1.0, help="multiplies every stage's time budget; "
                        "default %(default)s")
    parser.add_argument("--only", help="comma-separated stages to run, of " + ", ".join(s.name for s in STAGES) +
                        "; default all")
    parser.add_argument("--stage", help=argparse.SUPPRESS)  # a stage's own process
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage:
        from benchmarks.device.stages import run_stage as stage_process
        from llmtune.run.process_exit import run_and_exit

        # As an llmtune process ends (its collectives' threads may still let go of their tensors).
        run_and_exit(lambda: stage_process(args.stage, Path(args.work), Path(args.out), args.dry_run))
    names = args.only.split(",") if args.only else [s.name for s in STAGES]
    unknown = set(names) - {s.name for s in STAGES}
    if unknown:
        parser.error(f"--only: no stage {', '.join(sorted(unknown))}; the stages are "
                     + ", ".join(s.name for s in STAGES))
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / LOG).write_text("")
    report = {"dry_run": args.dry_run, "budget_scale": args.budget_scale,
              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "stages": {}}
    with tempfile.TemporaryDirectory(prefix="device_proof_") as work:
        for stage in (s for s in STAGES if s.name in names):
            command = [sys.executable, str(Path(__file__).resolve()), "--stage", stage.name, "--work", work,
                       "--out", str(out), *(["--dry-run"] if args.dry_run else [])]
            report["stages"][stage.name] = run_stage(stage, command, stage.budget_s * args.budget_scale, Path(work),
                                                     out / LOG)
            write_reports(report, out)
            print(stage_line(stage.name, report["stages"][stage.name]), flush=True)
    print(f"reports: {out / 'device_proof.md'}, {out / 'device_proof.json'}")


if __name__ == "__main__":
    main()
