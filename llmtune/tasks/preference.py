"""What the preference tasks (dpo, kto) share: the policy's dropout off, the reference model and the hook that
precomputes its values, and the per-sequence sums of the cp peers.

A micro-batch of a preference task holds rows of two sequences each (dpo: a pair's chosen and rejected responses;
kto: an example's completion and its mismatched one), numbered in turn by the collator. Under context parallelism
each cp peer holds a slice of every sequence: the per-sequence sums are added over the peers before a loss that is
not linear in them. Every peer then computes the same losses; each counts 1/cp of them, and its gradient flows
through its own slice only, scaled by cp (`whole_sums`), so that over the peers the value is counted once and the
gradient is exactly that of the whole sequences.
"""

import torch

from llmtune.tasks.objective import Objective
from llmtune.tasks.precompute import Precompute
from llmtune.tasks.reference import build_reference


def disable_dropout(hf_model) -> None:
    """Dropout off in the policy, as in the reference (TRL's disable_dropout): the nn.Dropout modules (peft's
    included) and the attention's own dropout probability."""
    for module in hf_model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def whole_sums(local: torch.Tensor, state) -> torch.Tensor:
    """Per-sequence sums over the cp peers' slices: the value of the whole sequences, and a gradient that reaches this
    rank's slice scaled by cp (the caller counts 1/cp of what it computes from them)."""
    if state.cp_size == 1:
        return local
    scaled = local * state.cp_size
    return scaled - (scaled - state.cp_sum(local)).detach()


def _preference_parts(config, local, model_config, model, features, state):
    """(the reference, the precompute hook or None) of a preference task's run, after the policy's dropout is turned
    off where the recipe says so."""
    preference = config.preference()
    if preference.disable_dropout:
        disable_dropout(model.hf_model)
    if not preference.needs_reference():
        return None, None
    precompute = Precompute(config, local, model_config, features, state) \
        if preference.reference == "precomputed" else None
    return build_reference(config, local, model_config, model, features, state), precompute


class PreferenceObjective(Objective):
    """A preference task's objective: its section of the recipe, its reference (None: its losses need none), the
    precompute hook of reference: precomputed."""

    def __init__(self, cfg, reference, state, precompute=None, shares_prefixes: bool = False):
        self.cfg, self.reference, self.state, self.precompute = cfg, reference, state, precompute
        # A row's second sequence leaves the prompt to its first (data/collate.share_prefix): computed once, by the
        # policy and the reference alike.
        self.shares_prefixes = shares_prefixes

    @classmethod
    def build(cls, config, local, model_config, model, features, state, **parts) -> "PreferenceObjective":
        reference, precompute = _preference_parts(config, local, model_config, model, features, state)
        return cls(config.preference(), reference, state, precompute, features.keep_shared_prefixes())

    def annotate(self, splits: dict, collate) -> dict:
        """reference: precomputed: the reference's log-probabilities added to every row, once."""
        if self.precompute is None:
            return splits
        splits, self.precompute = self.precompute(splits, collate), None
        return splits
