"""The user's own code a recipe names as `module:attribute` (grpo's reward functions, eval_generation's scorers,
train.callbacks), imported from where llmtune runs. Torch-free, in the recipe layer."""

import importlib
import operator
import os
import sys

from llmtune.errors import UserError


def import_named(name: str, key: str):
    """`module:attribute` (the attribute may be dotted) -> the object; UserError naming `key`, the recipe key that
    named it, when it cannot be had.

    Why the working directory is added: `python -m llmtune` (bin/llmtune, torchrun's workers) has it first on
    sys.path, the installed `llmtune` script does not, and a reward file beside the recipe is TRL's workflow. It goes
    last, so that a file of the user's never shadows a package llmtune imports (a datasets.py beside the recipe)."""
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute:
        raise UserError(f"{key}: {name!r} is not written module:name (e.g. my_rewards:sum_reward)")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        return operator.attrgetter(attribute)(importlib.import_module(module_name))
    except (ImportError, AttributeError, ValueError) as err:
        raise UserError(f"{key}: cannot import {name!r} ({type(err).__name__}: {err}); make the module importable "
                        "from where llmtune runs (the working directory or PYTHONPATH)") from None
