"""AdamW with decay / no-decay groups, and the learning-rate schedule."""

import math

import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import get_scheduler


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


def group_sizes(optimizer: torch.optim.AdamW) -> dict[str, tuple[int, int]]:
    """(tensors, elements) of build_optimizer's two groups, "decay" and "no_decay", each element counted once over
    the ranks (a sharded parameter's global size)."""
    decay, no_decay = optimizer.param_groups
    return {name: (len(group["params"]), sum(p.numel() for p in group["params"]))
            for name, group in (("decay", decay), ("no_decay", no_decay))}


def build_scheduler(optimizer, train_cfg, total_steps: int) -> LambdaLR:
    """transformers' own schedules, so that a recipe's curve is the one an HF Trainer user gets for the same names
    (schedule)."""
    name, warmup, kwargs = schedule(train_cfg, total_steps)
    return get_scheduler(name, optimizer, warmup, total_steps, kwargs)


def schedule(train_cfg, total_steps: int) -> tuple[str, int, dict]:
    """The recipe's schedule as transformers names it: (lr_scheduler_type, warm-up steps, lr_scheduler_kwargs).
    constant_with_warmup, linear (to 0), cosine_with_min_lr (to min_lr_ratio) and warmup_stable_decay (transformers'
    WSD: its warm-up starts from min_lr_ratio, its decay takes the last decay_steps to min_lr_ratio)."""
    warmup = train_cfg.warmup_steps or math.ceil(train_cfg.warmup_ratio * total_steps)
    kind = train_cfg.lr_scheduler_type
    if kind == "constant":
        return "constant_with_warmup", warmup, {}
    if kind == "linear":
        return "linear", warmup, {}
    if kind == "cosine":
        return "cosine_with_min_lr", warmup, {"min_lr_rate": train_cfg.min_lr_ratio}
    decay = train_cfg.decay_steps if train_cfg.decay_steps >= 1 else math.ceil(train_cfg.decay_steps * total_steps)
    return "warmup_stable_decay", warmup, {"num_decay_steps": int(decay), "decay_type": train_cfg.decay_type,
                                           "min_lr_ratio": train_cfg.min_lr_ratio}
