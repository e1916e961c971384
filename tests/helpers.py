"""Helpers the tests share: the CLI as a user runs it, and its outputs."""

import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """bin/llmtune as a user runs it, from the repository root."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run([str(REPO / "bin" / "llmtune"), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


