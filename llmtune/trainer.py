"""Trainer: the loop (optimizer steps of micro-batches) with global token counting, a non-finite guard
agreed by every rank, and evaluation."""

import math
import time

import torch
from torch.distributed.tensor import DTensor

from llmtune.errors import TrainingStopped
from llmtune.loss import IGNORE_INDEX
from llmtune.monitor import StepRecord


class Trainer:
    def __init__(self, model, optimizer, scheduler, data, monitor, state, train_cfg, validation, profiler=None,
                 checkpoints=None, sequence_shard=None):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.data = data
        self.monitor = monitor
        self.state = state
        self.cfg = train_cfg
        self.validation = validation  # data.manager.Validation: this rank's batches, and when they are due
        self.profiler = profiler
        self.checkpoints = checkpoints
        # Context parallelism: cuts each micro-batch to this rank's slice of the sequence.
        self.sequence_shard = sequence_shard or (lambda inputs: inputs)
        self.total_steps = data.total_steps(train_cfg)
        self.step = 0
        self.skipped_in_a_row = 0

    def train(self) -> None:
        self.model.train()
        steps = self.data.steps(self.total_steps - self.step)
        while self.step < self.total_steps:
            self.advance(steps)
        if self.checkpoints:
            self.checkpoints.finish_pending()

    def advance(self, steps) -> None:
        """One turn of the loop: the next optimizer step from `steps` (DataManager.steps), then its evaluation,
        record, profiler step and checkpoint when they are due."""
        started = time.perf_counter()
        epoch, micro_batches = next(steps)
        data_wait = time.perf_counter() - started
        stats = self.train_step(micro_batches)
        stats.data_wait, stats.step_time = data_wait, time.perf_counter() - started
        self.step += 1
        eval_loss = self.evaluate() if self.validation.due(self.step, self.step == self.total_steps) else None
        self.monitor.record(self.step, epoch, stats, eval_loss)
        if self.profiler:
            self.profiler.step()
        if self.profiler and self.step == self.total_steps:
            self.profiler.stop()
        stopping = self.skipped_in_a_row >= self.cfg.max_skipped_steps
        # A stop saves too: the skipped steps left the weights at the last good state.
        if self.checkpoints and (stopping or self.checkpoints.due(self.step, self.data.epoch_done, epoch,
                                                                   self.step == self.total_steps)):
            self.checkpoints.save(self.step, self.model, self.optimizer, self.state_dict())
        if stopping:
            if self.checkpoints:
                self.checkpoints.finish_pending()
            raise TrainingStopped(
                f"stopped at step {self.step}: {self.skipped_in_a_row} optimizer steps in a row had a non-finite "
                f"loss or gradient norm (train.max_skipped_steps={self.cfg.max_skipped_steps}); lower "
                "train.learning_rate, check the data, or train in fp32")

    def state_dict(self) -> dict:
        """Everything besides model and optimizer that decides what comes next; plain data."""
        return {"step": self.step, "skipped_in_a_row": self.skipped_in_a_row,
                "skipped_steps": self.monitor.skipped_steps, "data": self.data.state_dict(),
                "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.skipped_in_a_row = state["step"], state["skipped_in_a_row"]
        self.monitor.skipped_steps = state["skipped_steps"]
        self.data.load_state_dict(state["data"])
        self.scheduler.load_state_dict(state["scheduler"])

    def train_step(self, micro_batches) -> StepRecord:
        """One optimizer step.

        Every micro-batch contributes sum(CE) / T, T the labelled tokens of the whole step on all
        ranks, counted before the first forward. FSDP averages gradients over its N ranks, so the
        loss is also multiplied by N: the gradient is then exactly that of the global mean,
        whatever the split over ranks, micro-batches and accumulation steps. A non-finite loss or
        gradient norm (both global, so every rank sees the same) skips the update on every rank.
        """
        device = self.state.device
        batches = [self.sequence_shard(b.to(device).inputs) for b in micro_batches]
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
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm or float("inf"))
        grad_norm = (grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm).item()
        lr = self.scheduler.get_last_lr()[0]
        finite = math.isfinite(mean_loss) and math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
        self.skipped_in_a_row = 0 if finite else self.skipped_in_a_row + 1
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return StepRecord(loss=mean_loss, lr=lr, grad_norm=grad_norm, label_tokens=int(label_tokens),
                          input_tokens=int(input_tokens), samples=int(samples), step_time=0.0, data_wait=0.0,
                          skipped=not finite)

    def evaluate(self) -> float:
        """Validation loss: the token-weighted mean over the whole validation set, on all ranks."""
        self.model.eval()
        totals = torch.zeros(2, device=self.state.device, dtype=torch.float64)
        with torch.no_grad():
            for batch in self.validation.batches():
                inputs = self.sequence_shard(batch.to(self.state.device).inputs)
                totals[0] += self.model(**inputs).double()
                totals[1] += (inputs["shift_labels"] != IGNORE_INDEX).sum()
        self.model.train()
        loss_sum, count = self.state.all_reduce_sum(totals).tolist()
        return loss_sum / max(count, 1.0)
