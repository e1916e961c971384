"""What a feature is: the points where it may act, each called from one place of the build or the loop.

    check(config, model_config, world_size)  the launcher, before any process starts (features/registry.py)
    build(hf_model, state)                   model.build_model, before activation checkpointing and sharding
    distribute(hf_model, state)              model.build_model, once every feature has built: lay the parameters
                                             out over ranks beyond FSDP (tensor parallelism splits the layers with
                                             what the features added to them, adapters among them)
    pretrained_name(name)                    model.build_model: the pretrained checkpoint's name of a parameter the
                                             feature renamed, None for one it added
    weights_ready(hf_model)                  model.build_model, once the weights are loaded (or initialised) and
                                             sharded: the values of the parameters the feature added
    transform(inputs)                        Trainer, every micro-batch (training and evaluation), before its
                                             labels are counted and before the forward
    loss_terms(outputs, inputs)              CausalLMForTraining.forward: terms added to the micro-batch's summed
                                             loss, in its units (the trainer divides the sum by the step's
                                             labelled tokens)
    around_step(model)                       Trainer, a context around each training step's forwards and backwards
                                             (entered after the step's counts, left before its gradient clipping
                                             and optimizer step), on every rank
    step_metrics(state)                      Trainer, after each training step's micro-batches, on every rank: values
                                             for metrics.jsonl
    state_dict() / load_state_dict(state)    trainer_state.json of every checkpoint, under the feature's name
    export(folder, names)                    rank 0, end-of-training and offline export: extra files written into
                                             the HF folder before it is published

Every point does nothing until a feature overrides it; the Trainer never asks whether a feature is on.
"""

import contextlib
from pathlib import Path

import torch

from llmtune.model.state import saved_tensors


class Feature:
    """One feature of a run, made from the run's Config when `enabled(config)` says it is on."""

    name = ""
    # Whether the feature also acts on a frozen copy of the model (a preference task's reference model): what changes
    # how the model computes (its attention, its kernels), not what it trains.
    on_reference = False
    # What rows whose sequences share their beginning (data/collate.share_prefix: a branch attends to its document's
    # first segment) need of the feature once built: None, nothing; True, its attention attends them so; False, it
    # cannot compute them as the sequences alone (a varlen kernel ends a document at every segment).
    keeps_shared_prefixes: bool | None = None

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

    def distribute(self, hf_model, state) -> None:
        """Lay the HF model's parameters out over the ranks (as DTensors), once every feature has built."""

    def pretrained_name(self, name: str) -> str | None:
        """The name under which a pretrained checkpoint holds the model's parameter `name` (the feature may have
        wrapped its layer); None for a parameter the feature added, whose values weights_ready gives."""
        return name

    def weights_ready(self, hf_model) -> None:
        """The sharded model has its weights (pretrained ones loaded, or initialised): give the parameters the
        feature added their values."""

    def transform(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return inputs

    def loss_terms(self, outputs, inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """`outputs`: the decoder's outputs; `inputs`: the micro-batch the model was called with."""
        return None

    def around_step(self, model) -> contextlib.AbstractContextManager:
        """What holds while the training step's micro-batches run through `model` (the model being trained: every
        rank enters it, so it may reduce over them)."""
        return contextlib.nullcontext()

    def step_metrics(self, state) -> dict[str, float]:
        """Values of the training step whose micro-batches just ran, by metric name, the same on every rank: every
        rank calls it, so it may reduce over them (state: the ParallelState)."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """`state` is what this feature's state_dict gave when the checkpoint was written."""

    def export(self, folder: Path, names: list[str]) -> None:
        """`names`: the tensors the HF folder holds (written shard by shard, so their values are gone)."""


class Features:
    """The features a run has on, each point called on every one of them in registry order."""

    def __init__(self, features: list[Feature]):
        self.features = features

    def build(self, hf_model, state) -> None:
        for feature in self.features:
            feature.build(hf_model, state)
        for feature in self.features:
            feature.distribute(hf_model, state)

    def pretrained_tensors(self, hf_model) -> dict[str, torch.Tensor]:
        """The parameters and persistent buffers a pretrained checkpoint holds, by the checkpoint's names for them."""
        tensors = {}
        for name, tensor in saved_tensors(hf_model).items():
            for feature in self.features:
                name = feature.pretrained_name(name)
                if name is None:
                    break
            else:
                tensors[name] = tensor
        return tensors

    def weights_ready(self, hf_model) -> None:
        for feature in self.features:
            feature.weights_ready(hf_model)

    def for_reference(self, first: Feature) -> "Features":
        """The features of a frozen copy of the model: `first`, then those of this run that act on one."""
        return Features([first, *(feature for feature in self.features if feature.on_reference)])

    def find(self, kind: type) -> Feature | None:
        """The run's feature of this class, if it is on."""
        return next((feature for feature in self.features if isinstance(feature, kind)), None)

    def keep_shared_prefixes(self) -> bool:
        """Whether the built features compute rows that share prefixes as they compute each sequence alone: some
        feature's attention attends them so, and none objects."""
        votes = [feature.keeps_shared_prefixes for feature in self.features]
        return True in votes and False not in votes

    def transform(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for feature in self.features:
            inputs = feature.transform(inputs)
        return inputs

    def loss_terms(self, outputs, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        terms = (feature.loss_terms(outputs, inputs) for feature in self.features)
        return [term for term in terms if term is not None]

    @contextlib.contextmanager
    def around_step(self, model):
        with contextlib.ExitStack() as stack:
            for feature in self.features:
                stack.enter_context(feature.around_step(model))
            yield

    def step_metrics(self, state) -> dict[str, float]:
        return {key: value for feature in self.features for key, value in feature.step_metrics(state).items()}

    def state_dict(self) -> dict:
        return {feature.name: feature.state_dict() for feature in self.features}

    def load_state_dict(self, state: dict) -> None:
        # A feature that was off when the checkpoint was written (cp=1 resumed with cp=2) has nothing saved and
        # starts as built.
        for feature in self.features:
            if feature.name in state:
                feature.load_state_dict(state[feature.name])

    def export(self, folder: Path, names: list[str]) -> None:
        for feature in self.features:
            feature.export(folder, names)
