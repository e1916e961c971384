"""Read a pretrained HF folder (safetensors) into the sharded model: each rank reads from the files only the rows
of each tensor that its shard holds, so that no rank ever holds the full model.

Names: checkpoints keep the names a class had when they were written (GPT-NeoX's embed_out, a missing base-model
prefix, Mixtral's block_sparse_moe); transformers' own renaming rules for the class, as from_pretrained applies
them, translate them.

Layouts: transformers 5 holds some weights in another layout than checkpoints store them. The experts of a
mixture-of-experts layer are stored one by one (experts.N.gate_proj / up_proj / down_proj) and held as one tensor
per projection, the experts on dim 0 (experts.gate_up_proj, experts.down_proj). from_pretrained converts whole
tensors; here a rank reads only the experts of the rows of dim 0 its shard holds (FSDP2 shards dim 0) and applies
transformers' own operations of the conversion to them. That gives exactly its rows of the converted weight when
every operation keeps the rows of dim 0 apart: stacking per-expert tensors on dim 0, then concatenating,
transposing or interleaving other dims, as every mixture-of-experts conversion of transformers' causal LMs does.
Any other conversion is refused before the run starts, naming the class (check_pretrained).
"""

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (Concatenate, Interleave, MergeModulelist, Transpose, WeightConverter,
                                             WeightRenaming, dot_natural_key, rename_source_key)

from llmtune.errors import UserError
from llmtune.model.quantize import is_quantized
from llmtune.model.state import copy_rows, local_block, local_rows

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


@dataclass(frozen=True)
class Stored:
    """One tensor of a safetensors file: the file, where its data starts, the tensor's header entry."""
    path: Path
    data_start: int
    entry: dict

    @property
    def shape(self) -> list[int]:
        return list(self.entry["shape"])


@dataclass
class Converted:
    """A weight transformers builds from stored tensors by a conversion: for each of its source patterns, the
    stored tensors in the order from_pretrained takes them (expert 0 first)."""
    converter: WeightConverter
    parts: dict[str, list[Stored]] = field(default_factory=dict)

    @property
    def stacked(self) -> bool:
        """The parts are one tensor per expert, stacked on dim 0; else each part holds every expert on dim 0."""
        return isinstance(self.converter.operations[0], MergeModulelist)


def checkpoint_index(folder: Path) -> dict[str, Stored]:
    """Tensor name -> where it is stored."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({folder / name for name in json.loads(index.read_text())["weight_map"].values()})
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        raise UserError(f"model.name_or_path: {folder} holds no model.safetensors (or its index); llmtune loads "
                        "safetensors weights only — convert .bin weights with save_pretrained")
    tensors = {}
    for path in files:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        tensors.update({name: Stored(path, 8 + size, entry) for name, entry in header.items()})
    return tensors


def keeps_rows_apart(converter: WeightConverter) -> bool:
    """Row i of dim 0 of the converted weight comes from expert i (or row i of every part) alone, so that a rank
    can convert its own rows."""
    operations = converter.operations
    if isinstance(operations[0], MergeModulelist) and operations[0].dim == 0:
        operations = operations[1:]
    for operation in operations:
        if isinstance(operation, (Concatenate, Interleave)) and operation.dim >= 1:
            continue
        # A transpose that checks the dims is decided once from the whole stored shape (`decided`).
        if isinstance(operation, Transpose) and min(operation.dim0, operation.dim1) >= 1:
            continue
        return False
    return True


def weight_sources(hf_model: PreTrainedModel, folder: Path, tensors: dict, strict: bool = True,
                   new: set[str] = frozenset()) -> dict[str, Stored | Converted]:
    """The model's name -> where the checkpoint stores its value, for every tensor of `tensors` (the model's, by
    name: they tell whether the base-model prefix is added or dropped) that the checkpoint holds, and for the
    checkpoint's other tensors. Refuses a conversion a rank cannot apply to its own rows; with `strict`, also a
    checkpoint that lacks some of `tensors` or holds one in another shape (not_loaded names them otherwise). `new`:
    tensors the model adds to what its checkpoint may hold (a reward model's score head, build.new_head), never
    missing."""
    transforms = get_model_conversion_mapping(hf_model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    stored = checkpoint_index(folder)
    sources = {}
    # In from_pretrained's order, the one in which the experts of a converted weight are stacked.
    for name in sorted(stored, key=dot_natural_key):
        target, pattern = rename_source_key(name, renamings, converters, hf_model.base_model_prefix, tensors)
        if pattern is None:
            sources.setdefault(target, stored[name])
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        if not keeps_rows_apart(converter):
            model = type(hf_model).__name__
            raise UserError(f"model.name_or_path: {folder} stores {name} in a layout that transformers converts "
                            f"for {model} ({converter.operations}) and llmtune cannot convert rank by rank (each "
                            f"rank reads only the rows it holds): {model} is not supported; docs/models.md lists "
                            "the model families that are")
        source = sources.setdefault(target, Converted(converter))
        source.parts.setdefault(pattern, []).append(stored[name])
    if not strict:
        return sources
    missing = [name for name in tensors if name not in sources and name not in new]
    problems = [f"lacks weights for {few(missing, 5)}"] if missing else []
    problems += [problem for name, source in sources.items()
                 if name in tensors and (problem := shape_problem(name, source, list(tensors[name].shape)))]
    if problems:
        raise UserError(f"model.name_or_path: {folder} {'; '.join(problems)}; is it the checkpoint of this "
                        "architecture? (model.strict_load: false keeps the fresh initialisation of these tensors)")
    return sources


def shape_problem(name: str, source: Stored | Converted, shape: list[int]) -> str | None:
    """Why the stored tensor cannot fill the model's of `shape`; for a converted one, its experts are counted
    (the rows of dim 0), which its parts tell before they are converted."""
    if isinstance(source, Stored):
        return f"holds {name} in shape {source.shape} but the config gives {shape}" if source.shape != shape else None
    for pattern, parts in source.parts.items():
        rows = len(parts) if source.stacked else parts[0].shape[0]
        if rows != shape[0]:
            return f"holds {rows} experts for {name} ({pattern}) but the config gives {shape[0]}"
    return None


def not_loaded(hf_model: PreTrainedModel, sources: dict, tensors: dict) -> tuple[list[str], list[str], list[str]]:
    """What a lenient load leaves out: (the model's tensors the checkpoint lacks, those it holds in another shape,
    the checkpoint's tensors the model has no place for)."""
    missing = [name for name in tensors if name not in sources]
    reshaped = [name for name, source in sources.items()
                if name in tensors and shape_problem(name, source, list(tensors[name].shape))]
    # A tied weight's second name and a buffer the model computes are the model's, though no tensor of `tensors`.
    own = {name for name, _ in hf_model.named_parameters(remove_duplicate=False)}
    own |= {name for name, _ in hf_model.named_buffers(remove_duplicate=False)}
    unused = [name for name in sources if name not in tensors and name not in own]
    return missing, reshaped, unused


def few(names: list[str], shown: int = 3) -> str:
    """Names for a one-line message: the first few, then how many more."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def not_loaded_line(missing: list[str], reshaped: list[str], unused: list[str]) -> str:
    """One line on what a lenient load left out, or "" when it loaded everything."""
    parts = [f"{len(names)} {what} ({few(names)})" for names, what in (
        (missing, "missing from the source"), (reshaped, "of another shape"), (unused, "not in the model"))
        if names]
    return "; ".join(parts)


def fresh_value(plain: PreTrainedModel, name: str, seed: int) -> torch.Tensor:
    """The tensor `name` as transformers initialises it (its module's _init_weights: initializer_range, ones for
    norms), whole on the CPU, drawn from the seed and the name alone: the same on every rank, for any number of
    ranks, whatever else is loaded. `plain`: a model of the run's class and config on the meta device, of which only
    this tensor's module is materialised."""
    owner, _, leaf = name.rpartition(".")
    module = plain.get_submodule(owner).to_empty(device="cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + zlib.crc32(name.encode()))
        plain._init_weights(module)
    return getattr(module, leaf).detach()


def load_weights(hf_model: PreTrainedModel, folder: Path, tensors: dict[str, torch.Tensor], strict: bool = True,
                 seed: int = 0, new: set[str] = frozenset()) -> str:
    """Copy into every tensor's local shard the rows of its value that shard holds. `tensors`: the parameters and
    persistent buffers the checkpoint holds, by their names in the unchanged model (Features.pretrained_tensors).
    Without `strict`, a tensor the checkpoint lacks or holds in another shape takes its fresh value (fresh_value,
    from `seed`); returns the line naming what was left out (not_loaded_line; "" with `strict`). `new`: tensors the
    model adds to its checkpoint (weight_sources), which take their fresh value where the checkpoint lacks them.

    Parameters tied to another (lm_head to the embeddings) appear once and are loaded once.
    """
    sources = weight_sources(hf_model, folder, tensors, strict, new)
    missing, reshaped, unused = ([], [], []) if strict else not_loaded(hf_model, sources, tensors)
    missing = [name for name in missing if name not in new]
    fresh = {*missing, *reshaped, *(name for name in new if name not in sources)}
    if fresh:
        with torch.device("meta"):
            plain = type(hf_model)(hf_model.config)
    for name, tensor in tensors.items():
        local, block = local_rows(tensor), local_block(tensor)
        start = block[0].start if block else 0
        if name in fresh:
            with torch.no_grad():
                copy_rows(tensor, fresh_value(plain, name, seed))
            continue
        source = sources[name]
        if isinstance(source, Stored) and is_quantized(local):
            # Quantized whole, so that a rank's rows do not depend on the number of ranks (model/quantize.py): each
            # rank reads the whole weight, one at a time.
            with torch.no_grad():
                copy_rows(tensor, read_rows(source, 0, source.shape[0]))
        elif isinstance(source, Stored) and all(part == slice(0, size) for part, size in zip(block[1:],
                                                                                          source.shape[1:])):
            read_rows_into(local, source, start)
        elif isinstance(source, Stored):
            # A tensor-parallel rowwise weight: this rank's columns of its rows.
            with torch.no_grad():
                local.copy_(read_rows(source, start, len(local))[(slice(None), *block[1:])])
        elif len(local):
            value = converted_rows(source, start, len(local), name, hf_model)
            if value.shape != local.shape:
                raise UserError(f"model.name_or_path: the conversion of {name} gives rows of shape "
                                f"{list(value.shape)[1:]}, the model holds {list(local.shape)[1:]}")
            with torch.no_grad():
                local.copy_(value)
    return not_loaded_line(missing, reshaped, unused)


def converted_rows(source: Converted, start: int, count: int, name: str, hf_model: PreTrainedModel) -> torch.Tensor:
    """Rows [start, start + count) of a converted weight: the experts of those rows read from the files, then
    transformers' operations of the conversion applied to them as from_pretrained applies them to all."""
    converter = source.converter
    if source.stacked:
        inputs = {pattern: [read_rows(part, 0, part.shape[0]) for part in parts[start:start + count]]
                  for pattern, parts in source.parts.items()}
    else:
        inputs = {pattern: [read_rows(part, start, count) for part in parts] for pattern, parts in source.parts.items()}
    for operation in filter(None, (decided(operation, source, name, hf_model) for operation in converter.operations)):
        inputs = operation.convert(inputs, source_patterns=converter.source_patterns,
                                   target_patterns=converter.target_patterns, full_layer_name=name, model=hf_model,
                                   config=hf_model.config)
    (value,) = inputs.values()
    # Where no operation acted (a stored layout that is already the model's), the one tensor as it was read.
    return value[0] if isinstance(value, list) else value


def decided(operation, source: Converted, name: str, hf_model: PreTrainedModel):
    """The operation as it acts on the whole weight: a transpose that checks the dims (Qwen3-VL-MoE's experts:
    transposed where the stored shape is not the model's) compares the whole stored tensor's shape with the whole
    parameter's, which a rank's rows do not have; it becomes a plain transpose, or None where nothing is done."""
    if not (isinstance(operation, Transpose) and operation.check_dims):
        return operation
    stored = next(iter(source.parts.values()))[0].shape
    return Transpose(operation.dim0, operation.dim1) if stored != list(hf_model.get_parameter(name).shape) else None


def read_rows(source: Stored, start: int, count: int) -> torch.Tensor:
    rows = torch.empty([count, *source.shape[1:]], dtype=SAFETENSORS_DTYPES[source.entry["dtype"]])
    read_rows_into(rows, source, start)
    return rows


def read_rows_into(target: torch.Tensor, source: Stored, start: int) -> None:
    """The rows of one tensor from row `start` on, as many as `target` holds, read from the file alone with plain
    reads, not a memory map, so that the process holds nothing of the file but these rows: straight into `target`
    (this rank's shard) when it is on the CPU in the file's dtype, else through one buffer that is then copied and
    converted."""
    dtype = SAFETENSORS_DTYPES[source.entry["dtype"]]
    row_bytes = int(torch.Size(source.shape[1:]).numel()) * dtype.itemsize
    direct = target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()
    buffer = target.detach() if direct else torch.empty(target.shape, dtype=dtype)
    view = memoryview(buffer.view(-1).view(torch.uint8).numpy())
    with open(source.path, "rb", buffering=0) as f:
        f.seek(source.data_start + source.entry["data_offsets"][0] + start * row_bytes)
        done = 0
        while done < len(view):  # one read returns at most ~2 GiB on Linux
            got = f.readinto(view[done:])
            if not got:
                raise UserError(f"model.name_or_path: {source.path} ends inside a tensor; the file is truncated")
            done += got
    if not direct:
        with torch.no_grad():
            target.copy_(buffer)
