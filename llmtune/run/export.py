"""`llmtune export`: a DCP checkpoint of any world size -> the HF folder (or adapter folder) the end of training
writes, offline, on one process; the frozen weights of an adapter or partial run re-read from its base model (and
quantized again, for a run of model.quantize)."""

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from llmtune.checkpoint.hf_export import EXPORT_DTYPES, gather_weights, write_hf_folder
from llmtune.checkpoint.validate import check_base, check_complete, saved_model_shapes
from llmtune.config import load_config, parse_size
from llmtune.data import images
from llmtune.errors import UserError
from llmtune.features.adapters import Adapters, merge_adapters
from llmtune.features.base import Features
from llmtune.features.quantization import QuantizedBase
from llmtune.features.registry import enabled_features
from llmtune.model.build import auto_class, base_record, load_model_config, new_head
from llmtune.model.pretrained import load_weights
from llmtune.model.state import saved_tensors
from llmtune.run.inputs import fetch_hub_inputs, local_inputs


def checkpoint_model(checkpoint: Path, run, trainer_state: dict, features: Features):
    """The checkpoint's HF model on the CPU in fp32, adapters in their layers: the parameters the run trained from
    the checkpoint, the frozen ones (a run that trained adapters or some modules only) re-read from its base model,
    which must be the one it was trained on, and quantized as the run quantized them (model.quantize). `features`:
    those of the run that shape its weights (the adapters, the quantized base)."""
    config = AutoConfig.from_pretrained(checkpoint / "hf_config")
    with torch.device("meta"):
        model = auto_class(config).from_config(config, dtype=torch.float32)
    features.build(model, None)
    model.to_empty(device="cpu")
    model.tie_weights()
    if trainer_state.get("base"):
        local = local_inputs(run, fetch_hub_inputs(run))
        base_config = load_model_config(local.model, run.head())
        check_base(checkpoint, base_record(run, local.model, base_config))
        if local.model.name_or_path:
            tensors = features.pretrained_tensors(model)
            load_weights(model, Path(local.model.name_or_path), tensors, run.model.strict_load, run.train.seed,
                         new_head(model, tensors))
        else:  # trained from model.config: the frozen weights are its seeded initialisation
            torch.manual_seed(run.train.seed)
            initialised = auto_class(base_config).from_config(base_config, dtype=torch.float32)
            model.load_state_dict(initialised.state_dict(), strict=False)
    saved = saved_model_shapes(checkpoint, "model.hf_model.")
    dcp.load({f"model.hf_model.{name}": tensor.data for name, tensor in saved_tensors(model).items() if name in saved},
             checkpoint_id=str(checkpoint), no_dist=True)
    return model


def export_checkpoint(checkpoint: Path, out_dir: Path, dtype_name: str | None, overwrite: bool, merge: bool,
                      verify: bool = False) -> str:
    """Offline, one process: a DCP checkpoint (any world size) -> the same HF folder as the end of training; for a
    run that trained adapters, their adapter folder, or (merge) the HF folder with them merged.
    dtype_name None: the run's checkpoint.export_dtype. verify: check every file's checksum first. Returns the line
    that says what was written."""
    check_complete(checkpoint, verify)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise UserError(f"{out_dir}: exists and is not empty; choose another folder or pass --overwrite")
    saved = json.loads((checkpoint / "trainer_state.json").read_text())
    run = load_config(str(checkpoint / "config.yaml"), [], saved["task"], saved["world_size"])
    dtype_name = dtype_name or run.checkpoint.export_dtype
    if dtype_name not in EXPORT_DTYPES:
        raise UserError(f"--dtype: {dtype_name!r} is not one of {', '.join(EXPORT_DTYPES)}")
    features = enabled_features(run)
    adapters = features.find(Adapters)
    if merge and not adapters:
        raise UserError(f"--merge: {checkpoint} has no adapters to merge (peft.method is none); leave --merge out")
    dtype = EXPORT_DTYPES[dtype_name]
    model = checkpoint_model(checkpoint, run, saved,
                             Features([f for f in features.features if isinstance(f, (Adapters, QuantizedBase))]))
    source = checkpoint / "hf_config"
    tokenizer = AutoTokenizer.from_pretrained(source)
    # A vision-language model's exports hold its image processor's settings too, which the checkpoint keeps.
    images.attach(tokenizer, (str(source),), AutoConfig.from_pretrained(source), run.data)
    if adapters and not merge:
        adapters.export_adapter(model, tokenizer, out_dir, dtype, is_main=True)
        return exported_line(checkpoint, out_dir, "the adapter folder", dtype_name)
    if adapters:
        merge_adapters(model)
    generation = GenerationConfig.from_pretrained(source) if (source / "generation_config.json").is_file() else None
    write_hf_folder(gather_weights(model, dtype, True), model, generation, tokenizer, out_dir,
                    parse_size(run.checkpoint.max_shard_size), dtype, features)
    return exported_line(checkpoint, out_dir, "the HF folder, adapters merged" if adapters else "the HF folder",
                         dtype_name)


def exported_line(checkpoint: Path, out_dir: Path, folder: str, dtype_name: str) -> str:
    """What `llmtune export` wrote: the tensors counted in the folder's safetensors files, as written."""
    tensors = 0
    for path in out_dir.glob("*.safetensors"):
        with safe_open(path, "pt") as weights:
            tensors += len(weights.keys())
    return f"exported {checkpoint} to {out_dir} ({folder}: {tensors} tensors, {dtype_name})"
