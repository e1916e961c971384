"""train.ema_decay: exponential moving averages of the trainable parameters (as TRELLIS keeps them, one per decay).

Each average is an fp32 copy of every trainable parameter, made like it: a DTensor sharded as FSDP2 shards the
parameter, so each rank averages its own rows (no gather and no collective per step) and a checkpoint holds the
averages as DCP holds the parameters, loadable on any number of ranks. After every optimizer step that updated the
weights: average = decay x average + (1 - decay) x parameter, in fp32 whatever the compute dtype.

To evaluate or export an average, it is copied into the parameters' own storage (swapped_in) and the parameters'
values copied back after; FSDP2 all-gathers from that storage, so the model then computes with the average.
"""

from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a sharded tensor (the tensor itself when it is not one), sharing its storage."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def decay_name(decay: float) -> str:
    return f"{decay:g}"


class EMA:
    """The averages of one run; none (decays empty) does nothing."""

    def __init__(self, model, decays: list[float]):
        self.decays = list(decays)
        self.params = {name: param for name, param in model.named_parameters() if param.requires_grad}
        self.averages = {decay_name(decay): {name: param.detach().to(torch.float32, copy=True)
                                             for name, param in self.params.items()} for decay in self.decays}

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer step that changed the weights: one fused lerp per decay over this rank's rows."""
        if not self.decays:
            return
        values = [local(param).float() for param in self.params.values()]
        for decay in self.decays:
            averages = [local(average) for average in self.averages[decay_name(decay)].values()]
            torch._foreach_lerp_(averages, values, 1.0 - decay)

    def suffix(self, decay: float) -> str:
        """What names an average's metric and export folder: nothing for the one average of a run, its decay for
        several (eval_loss_ema, hf_ema; eval_loss_ema_0.999, hf_ema_0.999)."""
        return "" if len(self.decays) == 1 else f"_{decay_name(decay)}"

    def state_dict(self) -> dict:
        """The averages by decay and parameter name, sharded: DCP's content in a checkpoint (loaded in place)."""
        return self.averages

    def restart(self) -> None:
        """The averages start again from the parameters' values (a checkpoint written without them)."""
        for averages in self.averages.values():
            for name, average in averages.items():
                local(average).copy_(local(self.params[name].detach()))

    @contextmanager
    def swapped_in(self, decay: float):
        """The model computes with the average of `decay` inside the block; its own values come back after, bitwise."""
        kept = {name: local(param.detach()).clone() for name, param in self.params.items()}
        with torch.no_grad():
            for name, average in self.averages[decay_name(decay)].items():
                local(self.params[name]).copy_(local(average))
        try:
            yield
        finally:
            with torch.no_grad():
                for name, value in kept.items():
                    local(self.params[name]).copy_(value)
