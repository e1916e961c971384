"""train.fp16: dynamic loss scaling, with the rules and defaults of torch's GradScaler.

fp16's small range flushes small gradients to zero, so the loss is multiplied by a scale before backward and the
gradients divided by it after, before clipping. A step whose gradients overflowed (a non-finite global norm) is
skipped and the scale halved; after 2000 good steps in a row it doubles. torch's GradScaler is not used: it looks
for infinities per tensor on each rank and would need its own all-reduce for FSDP2's sharded gradients, while the
trainer already has the global gradient norm, the same on every rank, whose finiteness is that answer; the division
is done on each rank's own rows (no gather). The scale and its count of good steps are plain numbers kept in
trainer_state.json, so a resumed run scales exactly as the uninterrupted one.
"""

import torch
from torch.distributed.tensor import DTensor

INIT_SCALE = 2.0**16
GROWTH_INTERVAL = 2000


class LossScale:
    """The scale of a fp16 run; 1.0 and never changed otherwise."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.scale = INIT_SCALE if enabled else 1.0
        self.good_steps = 0

    def unscale(self, parameters: list) -> None:
        """Divide the gradients by the scale, each rank its own rows."""
        if not self.enabled:
            return
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in parameters if p.grad is not None]
        torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, finite: bool) -> None:
        """After a step: halve on an overflow, double after GROWTH_INTERVAL good steps in a row."""
        if not self.enabled:
            return
        if not finite:
            self.scale, self.good_steps = self.scale / 2.0, 0
            return
        self.good_steps += 1
        if self.good_steps == GROWTH_INTERVAL:
            self.scale, self.good_steps = self.scale * 2.0, 0

    def counts_skip(self) -> bool:
        """Whether a skipped step counts towards train.max_skipped_steps: always without fp16; with it only once the
        scale is below 1, where scaling is no longer the cause (overflows are the scale's to handle)."""
        return not self.enabled or self.scale < 1

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps} if self.enabled else {}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint of a run without fp16 has none: the scale then starts as new."""
        if self.enabled and state:
            self.scale, self.good_steps = state["scale"], state["good_steps"]
