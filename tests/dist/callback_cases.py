"""Callbacks that act on one rank only, which tests/dist/test_callback_ranks.py names in train.callbacks."""

from llmtune.training.callbacks import Callback


class StopOnRankOne(Callback):
    """Rank 1 alone asks to stop after step 2."""

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.rank == 1 and state.step == 2


class RaiseOnRankOne(Callback):
    """Rank 1 alone raises after step 3."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.rank == 1 and state.step == 3:
            raise RuntimeError("rank 1 gives up")
