"""Trainer: the loop (optimizer steps of micro-batches) with global token counting, a non-finite guard
agreed by every rank, and evaluation."""

import math
import time

import torch
from torch.distributed.tensor import DTensor

from llmtune.errors import Preempted, TrainingStopped
from llmtune.model.loss import IGNORE_INDEX
from llmtune.monitor.metrics import StepRecord
from llmtune.training.stop_signals import StopSignals


class Trainer:
    """Every part is always there and decides for itself when it acts: validation when an evaluation is due
    (never without validation data), the monitor when a record is due, the checkpoints when a save is due
    (never when the recipe saves none), the features on every micro-batch (none: unchanged)."""

    def __init__(self, model, optimizer, scheduler, data, validation, monitor, checkpoints, features, state,
                 train_cfg, total_steps: int):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.data = data
        self.validation = validation
        self.monitor = monitor
        self.checkpoints = checkpoints
        self.features = features
        self.state = state
        self.cfg = train_cfg
        self.total_steps = total_steps
        self.step = 0
        self.skipped_in_a_row = 0

    def train(self) -> None:
        self.monitor.begin(self.step)
        try:
            self.model.train()
            steps = self.data.steps(self.total_steps - self.step)
            with StopSignals(self.cfg.save_on_signals) as stop:
                while self.step < self.total_steps:
                    self.advance(steps)
                    if signal_name := stop.agreed(self.state):
                        self.stop_for(signal_name)
            self.checkpoints.finish_pending()
        finally:
            self.monitor.end()

    def stop_for(self, reason: str) -> None:
        """Save here (unless this step was just saved) and stop every rank with Preempted."""
        if self.checkpoints.saved_step != self.step:
            self.checkpoints.save(self.step, self.model, self.optimizer, self.state_dict())
        self.checkpoints.finish_pending()
        raise Preempted(f"stopped by {reason} after step {self.step} of {self.total_steps}; saved "
                        f"{self.checkpoints.root / f'global_step_{self.step}'}")

    def advance(self, steps) -> None:
        """One turn of the loop: the next optimizer step from `steps` (DataManager.steps), then its evaluation,
        record and checkpoint when they are due."""
        started = time.perf_counter()
        epoch, micro_batches = next(steps)
        data_wait = time.perf_counter() - started
        stats = self.train_step(micro_batches)
        stats.data_wait, stats.step_time = data_wait, time.perf_counter() - started
        self.step += 1
        last = self.step == self.total_steps
        eval_loss = self.evaluate() if self.validation.due(self.step, last) else None
        self.monitor.record(self.step, self.data.progress, stats, eval_loss)
        stopping = self.skipped_in_a_row >= self.cfg.max_skipped_steps
        # A stop saves too: the skipped steps left the weights at the last good state.
        if self.checkpoints.due(self.step, self.data.epoch_done, epoch, last or stopping):
            self.checkpoints.save(self.step, self.model, self.optimizer, self.state_dict())
        if stopping:
            self.checkpoints.finish_pending()
            raise TrainingStopped(
                f"stopped at step {self.step}: {self.skipped_in_a_row} optimizer steps in a row had a non-finite "
                f"loss or gradient norm (train.max_skipped_steps={self.cfg.max_skipped_steps}); lower "
                "train.learning_rate, check the data, or train in fp32")

    def state_dict(self) -> dict:
        """Everything besides model and optimizer that decides what comes next; plain data."""
        return {"step": self.step, "global_batch": self.data.global_batch, "skipped_in_a_row": self.skipped_in_a_row,
                "skipped_steps": self.monitor.skipped_steps, "data": self.data.state_dict(),
                "scheduler": self.scheduler.state_dict(), "features": self.features.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.skipped_in_a_row = state["step"], state["skipped_in_a_row"]
        self.monitor.skipped_steps = state["skipped_steps"]
        self.data.load_state_dict(state["data"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.features.load_state_dict(state["features"])

    def train_step(self, micro_batches) -> StepRecord:
        """One optimizer step.

        Every micro-batch contributes sum(CE) / T, T the labelled tokens of the whole step on all
        ranks, counted before the first forward. FSDP averages gradients over its N ranks, so the
        loss is also multiplied by N: the gradient is then exactly that of the global mean,
        whatever the split over ranks, micro-batches and accumulation steps. A non-finite loss or
        gradient norm (both global, so every rank sees the same) skips the update on every rank.
        """
        device = self.state.device
        batches = [self.features.transform(b.to(device).inputs) for b in micro_batches]
        # Labels are counted on the slices (each token once over dp x cp); whole rows only by one rank of each
        # cp group, whose peers hold the same rows.
        rows_here = self.state.cp_rank == 0
        counts = torch.tensor([sum(int((b["shift_labels"] != IGNORE_INDEX).sum()) for b in batches),
                               sum(b.num_tokens for b in micro_batches) * rows_here,
                               sum(len(b["input_ids"]) for b in batches) * rows_here], device=device,
                              dtype=torch.float64)
        label_tokens, input_tokens, samples = self.state.all_reduce_sum(counts).tolist()
        scale = self.state.fsdp_group_size / max(label_tokens, 1.0)
        loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        for i, batch in enumerate(batches):
            self.model.set_requires_gradient_sync(i == len(batches) - 1)
            loss = self.model(**batch)
            (loss * scale).backward()
            loss_sum += loss.detach()
        mean_loss = self.state.all_reduce_sum(loss_sum).item() / max(label_tokens, 1.0)
        feature_metrics = self.features.step_metrics(self.state)
        grad_norm = clip_gradients([p for p in self.model.parameters() if p.requires_grad], self.cfg.max_grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        finite = math.isfinite(mean_loss) and math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
        self.skipped_in_a_row = 0 if finite else self.skipped_in_a_row + 1
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return StepRecord(loss=mean_loss, lr=lr, grad_norm=grad_norm, label_tokens=int(label_tokens),
                          input_tokens=int(input_tokens), samples=int(samples), step_time=0.0, data_wait=0.0,
                          skipped=not finite, features=feature_metrics)

    def evaluate(self) -> float:
        """Validation loss: the token-weighted mean over the whole validation set, on all ranks."""
        self.model.eval()
        totals = torch.zeros(2, device=self.state.device, dtype=torch.float64)
        with torch.no_grad():
            for batch in self.validation.batches():
                inputs = self.features.transform(batch.to(self.state.device).inputs)
                totals[0] += self.model(**inputs).double()
                totals[1] += (inputs["shift_labels"] != IGNORE_INDEX).sum()
        self.model.train()
        loss_sum, count = self.state.all_reduce_sum(totals).tolist()
        return loss_sum / max(count, 1.0)


def clip_gradients(parameters: list, max_norm: float) -> float:
    """The global L2 norm of the gradients, before clipping them to max_norm (0: no clipping).

    Each parameter's norm is taken in fp64: summed in fp32, the squares of a sharded gradient come out
    differently rounded from those of the whole one, and a clipping factor differing in its last bits
    would make the updates depend on the number of ranks. In fp64 the difference is far below what
    fp32 can tell, and the factor comes out the same.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]))
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total.item()
