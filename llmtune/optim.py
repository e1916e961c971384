"""AdamW with decay / no-decay groups, and the learning-rate schedule."""

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def build_optimizer(model: torch.nn.Module, train_cfg) -> torch.optim.AdamW:
    """Biases and norm weights (1-D parameters) are not decayed; tied parameters appear once."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": train_cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    # One fused kernel per parameter group, on CPU as on CUDA (sharded DTensor parameters included): it
    # took about half the time of foreach on this stack.
    return torch.optim.AdamW(groups, lr=train_cfg.learning_rate, betas=(train_cfg.adam_beta1, train_cfg.adam_beta2),
                             eps=train_cfg.adam_epsilon, fused=True)


def lr_factor(step: int, warmup: int, total: int, kind: str, min_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based): linear warm-up from 0, then a
    constant, linear or cosine decay to min_ratio at the last step."""
    if step < warmup:
        return step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    decay = {"constant": 1.0, "linear": 1.0 - progress, "cosine": 0.5 * (1.0 + math.cos(math.pi * progress))}[kind]
    return min_ratio + (1.0 - min_ratio) * decay


def build_scheduler(optimizer, train_cfg, total_steps: int) -> LambdaLR:
    warmup = train_cfg.warmup_steps or math.ceil(train_cfg.warmup_ratio * total_steps)
    return LambdaLR(optimizer, lambda step: lr_factor(step, warmup, total_steps, train_cfg.lr_scheduler_type,
                                                      train_cfg.min_lr_ratio))
