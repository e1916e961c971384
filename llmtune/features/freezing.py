"""Fine-tune some layers only: train.trainable_modules / train.frozen_modules, regular expressions searched in the
parameter names. A frozen parameter is what an adapter run's base weights are: sharded like the others, never in
the optimizer, the clipping or the checkpoint (which records the base model instead, to re-read on resume)."""

import re

from llmtune.features.base import Feature
from llmtune.model.build import meta_model


def trainable_names(names: list[str], trainable: list[str], frozen: list[str]) -> set[str]:
    """The names that train: matched by a trainable pattern (every name when there is none) and by no frozen one."""
    def matched(name: str, patterns: list[str]) -> bool:
        return any(re.search(pattern, name) for pattern in patterns)

    return {name for name in names if (not trainable or matched(name, trainable)) and not matched(name, frozen)}


class Freezing(Feature):
    """On when train.trainable_modules or train.frozen_modules is set."""

    name = "freezing"

    @staticmethod
    def enabled(config) -> bool:
        return bool(config.train.trainable_modules or config.train.frozen_modules)

    @staticmethod
    def check(config, model_config, world_size: int) -> list[str]:
        """Every pattern matches a parameter of the model (built on the meta device), and something is left to
        train."""
        hf_model = meta_model(model_config, config.model)
        names = [name for name, _ in hf_model.named_parameters(remove_duplicate=False)]
        problems = [f"train.{key}: {pattern!r} matches no parameter of the model (names such as {names[1]!r})"
                    for key in ("trainable_modules", "frozen_modules") for pattern in getattr(config.train, key)
                    if not any(re.search(pattern, name) for name in names)]
        if not problems and not trainable_names(names, config.train.trainable_modules, config.train.frozen_modules):
            problems.append("train.frozen_modules: every parameter is frozen; nothing is left to train")
        return problems

    def build(self, hf_model, state) -> None:
        """A parameter with several names (the lm_head tied to the embeddings) trains when any of them does."""
        named = list(hf_model.named_parameters(remove_duplicate=False))
        chosen = trainable_names([name for name, _ in named], self.config.train.trainable_modules,
                                 self.config.train.frozen_modules)
        trains = {id(param) for name, param in named if name in chosen}
        for _, param in named:
            param.requires_grad_(id(param) in trains)
