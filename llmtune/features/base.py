"""What a feature is: the points where it may act, each called from one place of the build or the loop.

    check(config, model_config, world_size)  the launcher, before any process starts (features/registry.py)
    build(hf_model, state)                   model.build_model, before activation checkpointing and sharding
    transform(inputs)                        Trainer, every micro-batch (training and evaluation), before its
                                             labels are counted and before the forward
    loss_terms(outputs, inputs)              CausalLMForTraining.forward: terms added to the micro-batch's summed
                                             loss, in its units (the trainer divides the sum by the step's
                                             labelled tokens)
    state_dict() / load_state_dict(state)    trainer_state.json of every checkpoint, under the feature's name
    export(folder, weights)                  rank 0, end-of-training export: extra files written into the
                                             folder before it is published

Every point does nothing until a feature overrides it; the Trainer never asks whether a feature is on.
"""

from pathlib import Path

import torch


class Feature:
    """One feature of a run, made from the run's Config when `enabled(config)` says it is on."""

    name = ""

    def __init__(self, config):
        self.config = config

    @staticmethod
    def enabled(config) -> bool:
        raise NotImplementedError

    @staticmethod
    def check(config, model_config, world_size: int) -> list[str]:
        """Problems of the recipe with this feature on; `model_config` is the model's transformers config."""
        return []

    def build(self, hf_model, state) -> None:
        """Change the HF model before it is sharded (wrap attention, add adapters)."""

    def transform(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return inputs

    def loss_terms(self, outputs, inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """`outputs`: the decoder's outputs; `inputs`: the micro-batch the model was called with."""
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """`state` is what this feature's state_dict gave when the checkpoint was written."""

    def export(self, folder: Path, weights: dict[str, torch.Tensor]) -> None:
        """`weights`: the exported tensors by name (export dtype, rank 0)."""


class Features:
    """The features a run has on, each point called on every one of them in registry order."""

    def __init__(self, features: list[Feature]):
        self.features = features

    def build(self, hf_model, state) -> None:
        for feature in self.features:
            feature.build(hf_model, state)

    def transform(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for feature in self.features:
            inputs = feature.transform(inputs)
        return inputs

    def loss_terms(self, outputs, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        terms = (feature.loss_terms(outputs, inputs) for feature in self.features)
        return [term for term in terms if term is not None]

    def state_dict(self) -> dict:
        return {feature.name: feature.state_dict() for feature in self.features}

    def load_state_dict(self, state: dict) -> None:
        # A feature that was off when the checkpoint was written (cp=1 resumed with cp=2) has nothing saved and
        # starts as built.
        for feature in self.features:
            if feature.name in state:
                feature.load_state_dict(state[feature.name])

    def export(self, folder: Path, weights: dict[str, torch.Tensor]) -> None:
        for feature in self.features:
            feature.export(folder, weights)
