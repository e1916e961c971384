"""The items of benchmarks/device/proof.py's stages: each one passed, failed or skipped with its reason, written the
moment it starts and ends, so that a stage killed for its time or crashed keeps what it finished; planned_gib, the
plan's figure every run's item carries (stages.py and runs.py both take it from here, neither from the other). Also
pytest's hooks that write the tests stage's items (pytest -p benchmarks.device.items)."""

import json
import os
import time
import traceback
from pathlib import Path
from typing import Callable

NO_CUDA = "no CUDA"
RESULTS_ENV = "DEVICE_PROOF_RESULTS"  # the tests stage's results file, for the pytest hooks below
FAILURE_LINES = 12
# A CUDA error such as an illegal memory access leaves the process's CUDA context unusable: every later item of the
# stage would fail on it (seen on the first GPU: one item's error failed the 11 after it). The item is reported and
# the stage's process ends with this code, for the parent to start it again after the item.
CONTEXT_LOST = 3


class Skipped(Exception):
    """An item this machine cannot run; the message says why."""


class Failed(Exception):
    """An item that ran and found something wrong: the message, with the numbers it measured."""

    def __init__(self, reason: str, **numbers):
        super().__init__(reason)
        self.numbers = numbers


def last_lines(text: str, count: int = FAILURE_LINES) -> str:
    return "\n".join(text.strip().splitlines()[-count:])


class Results:
    """A stage's items in WORK/<stage>.jsonl, one line when an item starts and one when it ends, each written at once:
    what a killed stage finished is read back by the parent, and a stage started again after a crash goes on after
    the items that ended (the one it crashed in included, which the parent marks)."""

    def __init__(self, path: Path):
        self.path = path
        self.rows = {row["name"]: row for row in read_events(path) if row.pop("event") == "ended"}

    def write(self, event: str, row: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({**row, "event": event}) + "\n")

    def run(self, name: str, work: Callable[[], dict | None]) -> dict:
        """work() -> the item's numbers (passed); it raises Skipped (skipped, its reason), Failed (failed, its reason
        and numbers) or anything else (failed, the traceback's last lines). An item that ended is not run again."""
        if name in self.rows:
            return self.rows[name]
        self.write("started", {"name": name})
        started = time.monotonic()
        try:
            row = {"status": "passed", **(work() or {})}
        except Skipped as skip:
            row = {"status": "skipped", "reason": str(skip)}
        except Failed as failure:
            row = {"status": "failed", "reason": str(failure), **failure.numbers}
        except Exception as error:  # noqa: BLE001 - any error of an item is that item's failure, never the stage's
            row = {"status": "failed", "reason": last_lines(traceback.format_exc()), "lost": context_lost(error)}
        lost = row.pop("lost", False)
        row = {"name": name, **row, "seconds": round(time.monotonic() - started, 1)}
        self.write("ended", row)
        self.rows[name] = row
        if lost:
            os._exit(CONTEXT_LOST)
        return row


def context_lost(error: Exception) -> bool:
    """Whether the error left CUDA unusable in this process (torch.AcceleratorError: an illegal memory access, a
    device-side assert), rather than failing one call."""
    return type(error).__name__ == "AcceleratorError" or "CUDA error" in str(error)


def planned_gib(recipe: Path, task: str) -> float:
    """`llmtune plan`'s peak of a training step for the recipe (a run's config.yaml too) on one rank, in GiB: the
    number every run's item carries for part d."""
    from benchmarks.plan_accuracy import predicted
    from llmtune.config import load_config

    return predicted(load_config(str(recipe), [], task, 1), 1) / 2**30


def read_events(path: Path) -> list[dict]:
    """The lines a stage wrote; a line cut short by a kill is left out."""
    events = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return events


def interrupted(events: list[dict]) -> str | None:
    """The item that started and never ended, if any."""
    ended = {e["name"] for e in events if e["event"] == "ended"}
    return next((e["name"] for e in events if e["event"] == "started" and e["name"] not in ended), None)


def pytest_runtest_logstart(nodeid, location):
    """pytest's hook, for the tests stage: a test starts."""
    Results(Path(os.environ[RESULTS_ENV])).write("started", {"name": nodeid})


def pytest_runtest_logreport(report):
    """pytest's hook: a test's outcome as its setup (skipped, an error) or its call ends."""
    if report.when == "call" or (report.when == "setup" and not report.passed):
        row = {"name": report.nodeid, "status": report.outcome, "seconds": round(report.duration, 1)}
        if report.skipped:
            import torch

            # Without CUDA, a test marked cuda skips for want of it, whatever its own words.
            reason = report.longrepr[2].removeprefix("Skipped: ")
            row["reason"] = reason if torch.cuda.is_available() else f"{NO_CUDA}: {reason}"
        elif report.failed:
            row["reason"] = last_lines(report.longreprtext)
        Results(Path(os.environ[RESULTS_ENV])).write("ended", row)
