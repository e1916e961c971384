"""The paragraph that ends every run on rank 0: how far it got, what it cost, what it left where, and the commands
that go on from there. Read from the run's own records (metrics.jsonl, the checkpoints folder, the export), so it
counts the steps of earlier attempts that a resumed run continues."""

import json
from pathlib import Path

from llmtune.checkpoint.folders import complete_checkpoints


def run_summary(output_dir: Path, step: int, total_steps: int, seconds: float, outcome: str, resume: str) -> str:
    """step: the last optimizer step taken (a stop can come between two logged records); outcome: how the run ended
    ("finished", "stopped by SIGTERM", ...); resume: the command that continues it."""
    metrics = output_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    tokens = sum(record["input_tokens"] for record in records)
    parts = [f"run {outcome} at step {step} of {total_steps}: {tokens:,} tokens, {seconds:,.0f} s in this "
             "process"]
    if records:
        parts.append(f"last logged loss {records[-1]['loss']:.4f}")
    evals = [record["eval_loss"] for record in records if "eval_loss" in record]
    if evals:
        parts.append(f"eval loss {evals[-1]:.4f} at the end, best {min(evals):.4f}")
    checkpoints = complete_checkpoints(output_dir / "checkpoints")
    if checkpoints:
        parts.append(f"newest checkpoint {checkpoints[-1]} (export it with: llmtune export {checkpoints[-1]} OUT_DIR; "
                     f"go on from it with: {resume})")
    else:
        parts.append("no checkpoint saved (checkpoint.save_steps or save_epochs turn saving on)")
    # Export folders appear whole or not at all (checkpoint/publish.py).
    exported = [output_dir / name for name in ("hf", "adapter") if (output_dir / name).is_dir()]
    if exported:
        parts.append("exported to " + " and ".join(str(path) for path in exported))
    return "; ".join(parts) + "."
