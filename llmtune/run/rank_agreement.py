"""Before the first step, every rank checks that it holds what rank 0 holds: the same resolved recipe, the same
tokenized data and the same model. Ranks that differ (a node that reads another recipe file, another data folder or
another model snapshot) would otherwise train a mix, or hang in a collective whose shapes differ."""

import hashlib
import json

from llmtune.errors import UserError

# What to check when a kind of fingerprint differs, by the start of its key.
FIXES = {
    "data": "check that every node reads the same data files and tokenizer",
    "model": "check that every node reads the same model folder",
}


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_fingerprint(hf_model) -> str:
    """Parameter names, global shapes, dtypes and whether they train, and the model config (without the folder it
    was read from, which differs between nodes' caches); not the values, which would cost a pass over them."""
    config = json.loads(hf_model.config.to_json_string(use_diff=False))
    config.pop("_name_or_path", None)
    params = [[name, list(param.shape), str(param.dtype), param.requires_grad]
              for name, param in hf_model.named_parameters()]
    return digest([params, config])


def recipe_fingerprints(config) -> dict[str, str]:
    """Every recipe key (section.key, and the task) -> the hash of its value, from Config.to_dict, which holds nothing
    that depends on the rank or on the number of ranks."""
    recipe = {f"{section}.{key}": value
              for section, values in config.to_dict().items() for key, value in values.items()}
    return {key: digest(value) for key, value in {"task": config.task, **recipe}.items()}


def fingerprints(config, data, validation, test, hf_model) -> dict[str, str]:
    """Key -> hash: every recipe key, then the training, validation and test data, then the model."""
    return {**recipe_fingerprints(config), "data (training)": data.fingerprint,
            "data (validation)": validation.fingerprint, "data (test)": test.fingerprint,
            "model": model_fingerprint(hf_model)}


def first_difference(gathered: list[dict[str, str]]) -> str | None:
    """The message naming the first key (in rank 0's order) on which some rank differs from rank 0, and the first
    such rank; None when every rank agrees. The same on every rank, which all hold every rank's fingerprints."""
    reference = gathered[0]
    for key, value in reference.items():
        for rank, prints in enumerate(gathered[1:], start=1):
            if prints.get(key) != value:
                kind = key.partition(" ")[0]
                fix = FIXES.get(kind, "check that every node reads the same recipe")
                return f"{key} differs between ranks: rank {rank} has another value than rank 0 ({fix})"
    return None


def check_ranks_agree(state, config, data, validation, test, hf_model) -> None:
    """One all-gather of every rank's fingerprints; every rank raises the same UserError when one differs."""
    problem = first_difference(state.all_gather_object(fingerprints(config, data, validation, test, hf_model)))
    if problem:
        raise UserError(problem)
