"""TrainMonitor: turns per-step numbers into logged metrics (metrics.jsonl and the console), on rank 0."""

import json
import time
from pathlib import Path


class TrainMonitor:
    def __init__(self, output_dir: Path, logging_steps: int, total_steps: int, console: bool, is_main: bool):
        self.path = output_dir / "metrics.jsonl"
        self.logging_steps = logging_steps
        self.total_steps = total_steps
        self.console = console and is_main
        self.is_main = is_main
        self._reset()

    def _reset(self) -> None:
        self.losses: list[float] = []
        self.tokens = 0
        self.started = time.perf_counter()

    def log_step(self, step: int, epoch: int, loss: float, lr: float, grad_norm: float, tokens: int) -> None:
        """Record one optimizer step; every logging_steps (and at the last step) write the window's metrics:
        the mean of its step losses (each already the global token-weighted mean), the last lr and
        grad norm, and the tokens per second over the window."""
        self.losses.append(loss)
        self.tokens += tokens
        if step % self.logging_steps and step != self.total_steps:
            return
        elapsed = time.perf_counter() - self.started
        record = {"step": step, "epoch": epoch, "loss": sum(self.losses) / len(self.losses), "lr": lr,
                  "grad_norm": grad_norm, "tokens_per_s": self.tokens / elapsed if elapsed > 0 else 0.0}
        self._reset()
        if not self.is_main:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.console:
            print(f"step {step}/{self.total_steps} epoch {epoch} loss {record['loss']:.4f} lr {lr:.3e} "
                  f"grad_norm {grad_norm:.3f} tokens/s {record['tokens_per_s']:.0f}", flush=True)
