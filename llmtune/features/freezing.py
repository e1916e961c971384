"""Fine-tune some layers only: train.trainable_modules / train.frozen_modules, regular expressions searched in the
parameter names, and train.trainable_layers, LLaMA-Factory's freeze tuning (its finetuning_type freeze: the last N
decoder layers). A frozen parameter is what an adapter run's base weights are: sharded like the others, never in
the optimizer, the clipping or the checkpoint (which records the base model instead, to re-read on resume)."""

import re

from llmtune.features.base import Feature
from llmtune.model.build import SCORE, is_classifier, meta_model


def trainable_names(names: list[str], trainable: list[str] | None, frozen: list[str]) -> set[str]:
    """The names that train: matched by a trainable pattern (every name when `trainable` is None) and by no frozen
    one."""
    def matched(name: str, patterns: list[str]) -> bool:
        return any(re.search(pattern, name) for pattern in patterns)

    return {name for name in names if (trainable is None or matched(name, trainable)) and not matched(name, frozen)}


def layer_count(model_config) -> int | None:
    """The decoder layers of the model, read as LLaMA-Factory reads them (a composite model's text_config first)."""
    config = getattr(model_config, "text_config", None) or model_config
    return next((count for key in ("num_hidden_layers", "num_layers", "n_layer")
                 if (count := getattr(config, key, None))), None)


def freeze_parts(train, model_config, names: list[str]) -> tuple[list[str], list[str]]:
    """LLaMA-Factory's freeze tuning (its _setup_freeze_tuning) as the parts of parameter names that train, a name
    training when it holds one: `.{i}.{module}` (`.{i}.` for all) for each chosen layer i, and each extra module as
    it is named; with the problems of the modules the model has none of. LLaMA-Factory's own modules: what follows
    the first layer's index (`self_attn`, `mlp`, ...), and the second-to-last part of a name outside the layers
    (`embed_tokens`, `norm`, ...). Matched as LLaMA-Factory matches them, by substring: an extra `norm` also trains
    every layer's norms there, and so here, for a recipe brought from there must train the same weights."""
    layers = layer_count(model_config)
    if not layers:
        return [], [f"train.trainable_layers: {type(model_config).__name__} gives no layer count (num_hidden_layers, "
                    "num_layers, n_layer); choose the weights with train.trainable_modules"]
    count = train.trainable_layers
    chosen = range(max(0, layers - count), layers) if count > 0 else range(min(-count, layers))
    in_layers = {_layer_module(name) for name in names} - {None}
    outside = {name.split(".")[-2] for name in names if not re.search(r"\.\d+\.", name) and "." in name}
    problems = [f"train.trainable_layer_modules (freeze_trainable_modules): {module!r} is no module of the decoder "
                f"layers; choose from all, {', '.join(sorted(in_layers))}"
                for module in train.trainable_layer_modules if module != "all" and module not in in_layers]
    problems += [f"train.trainable_extra_modules (freeze_extra_modules): {module!r} is no module outside the decoder "
                 f"layers; choose from {', '.join(sorted(outside))}"
                 for module in train.trainable_extra_modules if module not in outside]
    parts = [f".{index}.{'' if module == 'all' else module}"
             for module in train.trainable_layer_modules for index in chosen]
    return parts + list(train.trainable_extra_modules), problems


def _layer_module(name: str) -> str | None:
    """What follows the index of the name's layer 0 (or 1, where layer 0 is unlike the others), as LLaMA-Factory
    finds a layer's modules."""
    mark = next((mark for mark in (".0.", ".1.") if mark in name), None)
    return name.split(mark)[-1].split(".")[0] if mark else None


def chosen_names(train, model_config, names: list[str]) -> tuple[set[str], list[str]]:
    """The parameter names that train under the train section's choice, and the problems of that choice on this
    model (its names: `names`)."""
    if train.trainable_layers is None:
        return trainable_names(names, train.trainable_modules or None, train.frozen_modules), []
    parts, problems = freeze_parts(train, model_config, names)
    # A reward model's score head is new: it trains, as LLaMA-Factory's value head does under freeze tuning.
    head = [rf"^{SCORE}\."] if is_classifier(model_config) else []
    patterns = train.trainable_modules + [re.escape(part) for part in parts] + head
    return trainable_names(names, patterns, train.frozen_modules), problems


class Freezing(Feature):
    """On when train.trainable_modules, train.frozen_modules or train.trainable_layers is set."""

    name = "freezing"

    @staticmethod
    def enabled(config) -> bool:
        return config.train.freezes()

    @staticmethod
    def check(config, model_config, world_size: int) -> list[str]:
        """Every pattern and module matches a parameter of the model (built on the meta device), and something is
        left to train."""
        hf_model = meta_model(model_config, config.model)
        names = [name for name, _ in hf_model.named_parameters(remove_duplicate=False)]
        problems = [f"train.{key}: {pattern!r} matches no parameter of the model (names such as {names[1]!r})"
                    for key in ("trainable_modules", "frozen_modules") for pattern in getattr(config.train, key)
                    if not any(re.search(pattern, name) for name in names)]
        chosen, layer_problems = chosen_names(config.train, model_config, names)
        problems += layer_problems
        if not problems and not chosen:
            problems.append("train: every parameter is frozen (trainable_modules, frozen_modules, trainable_layers); "
                            "nothing is left to train")
        return problems

    def build(self, hf_model, state) -> None:
        """A parameter with several names (the lm_head tied to the embeddings) trains when any of them does."""
        named = list(hf_model.named_parameters(remove_duplicate=False))
        chosen, _ = chosen_names(self.config.train, hf_model.config, [name for name, _ in named])
        trains = {id(param) for name, param in named if name in chosen}
        for _, param in named:
            param.requires_grad_(id(param) in trains)
