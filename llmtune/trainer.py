"""Trainer: the loop (optimizer steps of micro-batches), with global token counting."""

import torch
from torch.distributed.tensor import DTensor

from llmtune.loss import IGNORE_INDEX


class Trainer:
    def __init__(self, model, optimizer, scheduler, data, monitor, state, train_cfg):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.data = data
        self.monitor = monitor
        self.state = state
        self.max_grad_norm = train_cfg.max_grad_norm
        self.total_steps = data.total_steps(train_cfg)

    def train(self) -> None:
        self.model.train()
        for step, (epoch, micro_batches) in enumerate(self.data.steps(self.total_steps), start=1):
            lr = self.scheduler.get_last_lr()[0]
            loss, grad_norm, tokens = self.train_step(micro_batches)
            self.monitor.log_step(step, epoch, loss, lr, grad_norm, tokens)

    def train_step(self, micro_batches: list[dict]) -> tuple[float, float, int]:
        """One optimizer step; returns (global token-weighted mean loss, gradient norm, input tokens on all ranks).

        Every micro-batch contributes sum(CE) / T, T the labelled tokens of the whole step on all
        ranks, counted before the first forward. FSDP averages gradients over its N ranks, so the
        loss is also multiplied by N: the gradient is then exactly that of the global mean,
        whatever the split over ranks, micro-batches and accumulation steps.
        """
        device = self.state.device
        batches = [b.to(device).inputs for b in micro_batches]
        counts = torch.tensor([sum(int((b["shift_labels"] != IGNORE_INDEX).sum()) for b in batches),
                               sum(b.num_tokens for b in micro_batches)], device=device, dtype=torch.float64)
        label_tokens, input_tokens = self.state.all_reduce_sum(counts).tolist()
        scale = self.state.fsdp_group_size / max(label_tokens, 1.0)
        loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        for i, batch in enumerate(batches):
            self.model.set_requires_gradient_sync(i == len(batches) - 1)
            loss = self.model(**batch)
            (loss * scale).backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm or float("inf"))
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        mean_loss = self.state.all_reduce_sum(loss_sum).item() / max(label_tokens, 1.0)
        return mean_loss, grad_norm.item(), int(input_tokens)
