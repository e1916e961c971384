"""AdamW with decay / no-decay groups, and the learning-rate schedule."""

import math

import torch
from transformers import get_scheduler


def build_optimizer(model: torch.nn.Module, train_cfg) -> torch.optim.AdamW:
    """Biases and norm weights (1-D parameters) are not decayed; tied parameters appear once."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": train_cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=train_cfg.learning_rate, betas=(train_cfg.adam_beta1, train_cfg.adam_beta2),
                             eps=train_cfg.adam_epsilon)


def build_scheduler(optimizer, train_cfg, total_steps: int):
    warmup = train_cfg.warmup_steps or math.ceil(train_cfg.warmup_ratio * total_steps)
    return get_scheduler(train_cfg.lr_scheduler_type, optimizer, num_warmup_steps=warmup,
                         num_training_steps=total_steps)
