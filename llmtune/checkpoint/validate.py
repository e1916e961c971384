"""Checks on a checkpoint before anything is loaded from it: complete, not truncated, the same model."""

import json
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from llmtune.checkpoint.manifest import manifest_problems
from llmtune.errors import UserError

REQUIRED = (".metadata", "trainer_state.json", "config.yaml")


def check_complete(path: Path, checksums: bool = False) -> None:
    """Every file the checkpoint needs is there and as long as its metadata and manifest say; with `checksums`, each
    file's bytes are those written."""
    if not path.is_dir():
        raise UserError(f"{path}: no such checkpoint folder")
    if path.name.startswith("."):
        raise UserError(f"{path}: an unfinished checkpoint (its save never completed); resume from a "
                        "global_step_N folder or from latest")
    missing = [name for name in REQUIRED if not (path / name).is_file()]
    if missing:
        raise UserError(f"{path}: incomplete checkpoint, missing {', '.join(missing)}; use another checkpoint")
    ends: dict[str, int] = {}
    for info in FileSystemReader(str(path)).read_metadata().storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        shard = path / name
        if not shard.is_file():
            raise UserError(f"{path}: shard {name} is missing; the checkpoint cannot be loaded")
        if shard.stat().st_size < end:
            raise UserError(f"{path}: shard {name} is truncated ({shard.stat().st_size} of {end} bytes)")
    problems = manifest_problems(path, checksums)
    if problems:
        raise UserError(f"{path}: damaged checkpoint: {'; '.join(problems[:4])}; use another checkpoint")


def check_base(path: Path, base: dict) -> None:
    """A checkpoint that holds only the trained parameters (it records its base) continues on the base model it was
    trained on. `base`: this run's (None when it trains every weight: check_model_matches tells that apart)."""
    saved = json.loads((path / "trainer_state.json").read_text())
    if saved.get("base") and base and saved["base"]["fingerprint"] != base["fingerprint"]:
        raise UserError(f"{path}: holds only the trained parameters of a run on {saved['base']['name_or_path']}, but "
                        f"the recipe's model {base['name_or_path']} has other weights (fingerprint "
                        f"{base['fingerprint']}, not {saved['base']['fingerprint']}); resume with the base model the "
                        "checkpoint was trained on")


def saved_model_shapes(path: Path, prefix: str = "model.") -> dict[str, list[int]]:
    metadata = FileSystemReader(str(path)).read_metadata()
    return {key[len(prefix):]: list(entry.size) for key, entry in metadata.state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}


def check_model_matches(path: Path, model_state: dict) -> None:
    """The model being built has the checkpoint's parameter names and shapes; else say which differ."""
    saved = saved_model_shapes(path)
    current = {name: list(tensor.shape) for name, tensor in model_state.items()}
    problems = [f"{name} missing from the checkpoint" for name in current.keys() - saved.keys()]
    problems += [f"{name} not in this model" for name in saved.keys() - current.keys()]
    problems += [f"{name}: checkpoint {saved[name]} vs model {current[name]}"
                 for name in current.keys() & saved.keys() if saved[name] != current[name]]
    if problems:
        shown = "; ".join(sorted(problems)[:6])
        more = f" (and {len(problems) - 6} more)" if len(problems) > 6 else ""
        raise UserError(f"{path}: the recipe's model differs from the checkpoint's: {shown}{more}; resume with the "
                        "model the checkpoint was trained with")
