"""Checks on a checkpoint before anything is loaded from it: complete, not truncated, the same model."""

import json
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from llmtune.checkpoint.folders import check_checkpoint_folder
from llmtune.checkpoint.manifest import manifest_problems
from llmtune.command import command_line
from llmtune.errors import UserError
from llmtune.model.pretrained import not_loaded_line


def check_complete(path: Path, checksums: bool = False) -> None:
    """Every file the checkpoint needs is there and as long as its metadata and manifest say; with `checksums`, each
    file's bytes are those written."""
    check_checkpoint_folder(path)
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


def check_base(path: Path, base: dict, fix: str = "resume with the base model the checkpoint was trained on") -> None:
    """A checkpoint that holds only the trained parameters (it records its base) continues on the base model it was
    trained on. `base`: this run's (None when it trains every weight: check_model_matches tells that apart)."""
    saved = saved_base(path)
    if saved and base and saved["fingerprint"] != base["fingerprint"]:
        raise UserError(f"{path}: holds only the trained parameters of a run on {saved['name_or_path']}, but "
                        f"the recipe's model {base['name_or_path']} has other weights (fingerprint "
                        f"{base['fingerprint']}, not {saved['fingerprint']}); {fix}")


def saved_base(path: Path) -> dict | None:
    """The base model a checkpoint of the trained parameters alone was trained on (None: it holds every weight)."""
    return json.loads((path / "trainer_state.json").read_text()).get("base")


def saved_model_shapes(path: Path, prefix: str = "model.") -> dict[str, list[int]]:
    metadata = FileSystemReader(str(path)).read_metadata()
    return {key[len(prefix):]: list(entry.size) for key, entry in metadata.state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}


def model_differences(saved: dict[str, list[int]], current: dict[str, list[int]]) -> tuple[list, list, list]:
    """(the current model's tensors the checkpoint lacks, those it holds in another shape, its tensors the model
    lacks), by name -> shape, each sorted."""
    missing = sorted(current.keys() - saved.keys())
    reshaped = sorted(name for name in current.keys() & saved.keys() if saved[name] != current[name])
    return missing, reshaped, sorted(saved.keys() - current.keys())


def check_model_matches(path: Path, model_state: dict) -> None:
    """The model being built has the checkpoint's parameter names and shapes; else say which differ."""
    saved = saved_model_shapes(path)
    current = {name: list(tensor.shape) for name, tensor in model_state.items()}
    missing, reshaped, unused = model_differences(saved, current)
    problems = [f"{name} missing from the checkpoint" for name in missing]
    problems += [f"{name} not in this model" for name in unused]
    problems += [f"{name}: checkpoint {saved[name]} vs model {current[name]}" for name in reshaped]
    if problems:
        shown = "; ".join(sorted(problems)[:6])
        more = f" (and {len(problems) - 6} more)" if len(problems) > 6 else ""
        raise UserError(f"{path}: the recipe's model differs from the checkpoint's: {shown}{more}; resume with the "
                        "model the checkpoint was trained with")


def init_from_plan(path: Path, base: dict | None, current: dict[str, list[int]] | None, strict: bool,
                   checksums: bool) -> tuple[list[str], str]:
    """model.init_from: a complete checkpoint, trained on this run's base when it holds only the trained parameters,
    that holds the tensors of `current` (name -> shape: the run's trained state, as checkpoints name it; None when
    only the run knows it). Returns (the names to load, the line naming what a lenient load leaves out, "" when
    nothing); with `strict`, any difference is refused instead. `base`: this run's base_record, or None."""
    try:
        check_complete(path, checksums)
        check_base(path, base, "set model.name_or_path (or model.config) to the model it was trained on")
    except UserError as err:
        raise UserError(f"model.init_from: {err}") from None
    if current is None:
        return [], ""
    saved = saved_model_shapes(path)
    missing, reshaped, unused = model_differences(saved, current)
    if strict and (missing or reshaped or unused):
        if saved_base(path):
            fix = (f"it holds only the parameters its run trained (adapters, train.trainable_modules): start from it "
                   f"with that run's peft and train settings (its config.yaml), or export it "
                   f"({command_line('export', path, 'DIR')}, --merge for adapters) and set model.name_or_path: DIR")
        else:
            fix = (f"start from a checkpoint of this model and kind of run (a run with frozen weights reads them from "
                   f"model.name_or_path: export a full checkpoint with {command_line('export', path, 'DIR')} and set "
                   "model.name_or_path: DIR)")
        shapes = [f"{name} {saved[name]} vs {current[name]}" for name in reshaped]
        raise UserError(f"model.init_from: {path} does not hold this run's model: "
                        f"{_hf_names(not_loaded_line(missing, shapes, unused))}; {fix}, or set model.strict_load: "
                        "false to load the tensors that match")
    return ([name for name in current if name in saved and name not in reshaped],
            _hf_names(not_loaded_line(missing, reshaped, unused)))


def _hf_names(line: str) -> str:
    """Tensor names as the HF model has them, without the prefix of the FSDP root that checkpoints add."""
    return line.replace("hf_model.", "")
