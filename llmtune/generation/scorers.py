"""eval_generation's scoring functions and grpo's reward functions, with TRL's reward-function signature: f(prompts,
completions, completion_ids, **columns) -> one float or None per completion, where `columns` are the prompt rows'
other columns, each a list aligned with the completions. The built-ins (accuracy, numeric_match, regex_match) have
the same one; a recipe's own are named package.module:function; a reward model's folder scores through
generation/reward_model.py. Torch-free: the CLI checks them before any process starts."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from llmtune.checkpoint.folders import EMA_EXPORTS, EXPORTS
from llmtune.errors import UserError
from llmtune.user_code import import_named

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class Scorer:
    """A scoring function and the name its mean is logged under (eval_gen/<name>)."""
    name: str
    function: Callable


def completion_text(completion) -> str:
    """A completion's text, from either of TRL's forms (a string, or the assistant's messages)."""
    return completion if isinstance(completion, str) else "".join(m["content"] for m in completion)


def _accuracy(column: str):
    def accuracy(prompts, completions, completion_ids, **columns) -> list[float]:
        return [float(completion_text(c).strip() == str(answer).strip())
                for c, answer in zip(completions, columns[column])]
    return accuracy


def _last_number(text: str) -> float | None:
    found = NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


def _numeric_match(column: str):
    def numeric_match(prompts, completions, completion_ids, **columns) -> list[float]:
        scores = []
        for c, answer in zip(completions, columns[column]):
            got, expected = _last_number(completion_text(c)), _last_number(str(answer))
            scores.append(float(got is not None and expected is not None and math.isclose(got, expected)))
        return scores
    return numeric_match


def _regex_match(pattern: str):
    compiled = re.compile(pattern, re.DOTALL)

    def regex_match(prompts, completions, completion_ids, **columns) -> list[float]:
        return [float(compiled.match(completion_text(c)) is not None) for c in completions]
    return regex_match


def _reward_model(folder: str):
    """A reward model's scores, as a scoring function: the model (torch, transformers) loaded on its first call."""
    loaded = []

    def reward_model(prompts, completions, completion_ids, **columns) -> list[float]:
        if not loaded:
            from llmtune.generation.reward_model import RewardModel

            loaded.append(RewardModel(folder))
        return loaded[0](prompts, completions)
    return reward_model


def answer_scorers(names: list[str]) -> list[str]:
    """The built-ins among `names` that compare with an answer column."""
    return [name for name in names if name in ("accuracy", "numeric_match")]


def load_scorers(names: list[str], answer_column: str, regex: str | None, key: str) -> list[Scorer]:
    """The scoring functions `names` (the recipe's `key`: eval_generation.scorers, grpo.reward_funcs), the built-ins
    made with answer_column and regex, the others imported; UserError naming the entry that cannot be had."""
    builtins = {"accuracy": lambda: _accuracy(answer_column),
                "numeric_match": lambda: _numeric_match(answer_column),
                "regex_match": lambda: _regex_match(regex)}
    scorers = []
    for name in names:
        if name in builtins:
            scorers.append(Scorer(name, builtins[name]()))
            continue
        if ":" not in name and "/" in name:  # a reward model's folder, loaded when it first scores
            if not (Path(name) / "config.json").is_file():
                raise UserError(f"{key}: {name} is not a HF model folder (no config.json there); point it at a reward "
                                "model's folder (AutoModelForSequenceClassification), e.g. a run's output_dir/hf")
            scorers.append(Scorer(reward_model_name(Path(name)), _reward_model(name)))
            continue
        function = import_named(name, key)
        if not callable(function):
            raise UserError(f"{key}: {name!r} is not a function")
        scorers.append(Scorer(getattr(function, "__name__", name.partition(":")[2]), function))
    given = [scorer.name for scorer in scorers]
    twice = sorted({name for name in given if given.count(name) > 1})
    if twice:
        raise UserError(f"{key}: {', '.join(twice)} named twice: each scorer's metrics (rewards/NAME/mean, "
                        "eval_gen/NAME) need a name of their own; list each once, or give a copy another name")
    return scorers


def reward_model_name(folder: Path) -> str:
    """A reward model's name in the metrics: its folder's name, as TRL names a model by the last part of its path;
    for an llmtune export (output_dir/hf, hf_ema...), whose folder name every run shares, the run's folder's before it
    (runs/rm/hf: rm-hf)."""
    folder = folder.resolve()
    exported = folder.name in EXPORTS or folder.name.startswith(EMA_EXPORTS)
    return f"{folder.parent.name}-{folder.name}" if exported else folder.name


def score(scorers: list[Scorer], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list], key: str, batch: str) -> dict[str, list[float | None]]:
    """Every scorer's scores of the completions. A scorer that raises, or returns other than one float or None per
    completion, is a UserError naming it (the recipe's `key` that named it) and the `batch` it scored: its scores
    would be no measure of the model."""
    scores = {}
    for scorer in scorers:
        try:
            values = scorer.function(prompts=prompts, completions=completions, completion_ids=completion_ids,
                                     **columns)
        except Exception as err:
            raise UserError(f"{key}: {scorer.name} raised {type(err).__name__}: {err} (scoring {batch})") from None
        odd = next((v for v in values if not (v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)))),
                   None) if isinstance(values, (list, tuple)) else None
        if not isinstance(values, (list, tuple)) or len(values) != len(completions) or odd is not None:
            got = type(values).__name__ if not isinstance(values, (list, tuple)) else \
                f"{len(values)} values" if len(values) != len(completions) else f"{odd!r}, a {type(odd).__name__},"
            raise UserError(f"{key}: {scorer.name} returned {got} for {len(completions)} completions (scoring "
                            f"{batch}); return one float (or None) per completion")
        scores[scorer.name] = [None if v is None else float(v) for v in values]
    return scores
