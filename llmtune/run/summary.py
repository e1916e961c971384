"""What a run leaves: its result (what `llmtune.train` returns) and the paragraph that ends every run on rank 0 (how
far it got, what it cost, what it left where, and the commands that go on from there). Read from the run's own
records (metrics.jsonl, the checkpoints folder, the export), so that it counts the steps of earlier attempts that a
resumed run continues."""

import json
from dataclasses import dataclass
from pathlib import Path

from llmtune.checkpoint.folders import EXPORTS, complete_checkpoints
from llmtune.command import command_line
from llmtune.config import GENERATION_METRICS


@dataclass(frozen=True)
class RunResult:
    """The run as its records tell it. Losses are the logged ones (the mean over the tokens of the steps each
    record covers); None where the run logged none."""

    output_dir: Path
    steps: int  # the optimizer steps taken, earlier attempts that a resumed run continues included
    total_steps: int
    tokens: int  # input tokens trained on, over every rank
    loss: float | None  # the last logged training loss
    eval_loss: float | None  # the last evaluation's
    best_eval_loss: float | None
    test_loss: float | None  # the test split's (data.test_files), evaluated once when training ended
    metrics: dict  # the task's own metrics (dpo's rewards/margins, ...) of the last logged training record
    eval_metrics: dict  # the newest value of every eval_ metric (eval_loss, eval_rewards/accuracies, eval_gen/...)
    checkpoint: Path | None  # the newest complete checkpoint
    export: Path | None  # output_dir/hf: the HF folder (adapter runs: merged, when checkpoint.export_merged)
    adapter: Path | None  # output_dir/adapter: the adapter folder of a run that trained adapters


def run_result(output_dir: Path, step: int, total_steps: int, task_metrics: tuple[str, ...]) -> RunResult:
    """step: the last optimizer step taken (a stop can come between two logged records); task_metrics: the names of
    the task's own metrics (Objective.metric_names)."""
    metrics = output_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    evals = [record["eval_loss"] for record in records if "eval_loss" in record]
    tests = [record["test_loss"] for record in records if "test_loss" in record]
    trained = [record for record in records if "loss" in record]  # not an evaluation's own record
    losses = [record["loss"] for record in trained]
    # Each evaluation's own: the validation's and the evaluation by generation's may fall at different steps.
    newest_eval = {key: value for record in records for key, value in record.items() if key.startswith("eval_")}
    checkpoints = complete_checkpoints(output_dir / "checkpoints")
    # Export folders appear whole or not at all (llmtune/atomic.py).
    hf, adapter = (output_dir / name if (output_dir / name).is_dir() else None for name in EXPORTS)
    return RunResult(output_dir, step, total_steps, sum(record.get("input_tokens", 0) for record in records),
                     losses[-1] if losses else None, evals[-1] if evals else None,
                     min(evals) if evals else None, tests[-1] if tests else None,
                     {key: value for key, value in (trained[-1] if trained else {}).items() if key in task_metrics},
                     newest_eval,
                     checkpoints[-1] if checkpoints else None, hf, adapter)


def run_summary(result: RunResult, seconds: float, outcome: str, resume: str, checkpoint_cfg) -> str:
    """outcome: how the run ended ("finished", "stopped by SIGTERM", ...); resume: the command that continues it;
    checkpoint_cfg: the recipe's checkpoint section (whether it saves, the export's dtype)."""
    parts = [f"run {outcome} at step {result.steps} of {result.total_steps}: {result.tokens:,} tokens, {seconds:,.0f} "
             "s in this process"]
    if result.loss is not None:
        parts.append(f"last logged loss {result.loss:.4f}")
    if result.eval_loss is not None:
        parts.append(f"eval loss {result.eval_loss:.4f} at the end, best {result.best_eval_loss:.4f}")
    generated = [f"{key} {value:.4f}" for key, value in result.eval_metrics.items()
                 if key.startswith(GENERATION_METRICS)]
    if generated:
        parts.append(", ".join(generated) + " at the end")
    if result.test_loss is not None:
        parts.append(f"test loss {result.test_loss:.4f}")
    if result.checkpoint:
        parts.append(f"newest checkpoint {result.checkpoint} (export it with: "
                     f"{command_line('export', result.checkpoint, 'OUT_DIR')}; go on from it with: {resume})")
    else:
        saves = checkpoint_cfg.save_steps or checkpoint_cfg.save_epochs
        parts.append("no checkpoint saved (the run ended before its first save)" if saves else
                     "no checkpoint saved (checkpoint.save_steps or save_epochs turn saving on)")
    exported = [path for path in (result.export, result.adapter) if path]
    if exported:
        # The dtype said: an fp32 run exports bf16 weights unless the recipe says otherwise.
        parts.append("exported to " + " and ".join(str(path) for path in exported)
                     + f" ({checkpoint_cfg.export_dtype} weights: checkpoint.export_dtype)")
    return "; ".join(parts) + "."
