"""Write weights as a HF folder that AutoModelForCausalLM.from_pretrained loads: safetensors shards with
their index, config.json, generation_config.json and the tokenizer (with its chat template), plus the
files the run's features add.

Two sources share one writer: the FSDP model at the end of training (gathered one parameter at a
time to rank 0, which keeps only the export-dtype copy: one full copy of the model in the export
dtype plus one parameter in fp32 at the peak), and a DCP checkpoint of any world size, offline.
"""

import copy
import json
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.core_model_loading import revert_weight_conversion

from llmtune.checkpoint.validate import check_complete
from llmtune.config import load_config, parse_size
from llmtune.errors import UserError
from llmtune.features.base import Features
from llmtune.features.registry import enabled_features

EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def gather_weights(hf_model, dtype: torch.dtype, is_main: bool) -> dict[str, torch.Tensor]:
    """name -> full tensor in `dtype` on rank 0's CPU (empty elsewhere). Every rank takes part in each gather.
    Tied parameters appear once (named_parameters skips the second name)."""
    weights = {}
    for name, param in hf_model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
        if is_main:
            weights[name] = full.to(device="cpu", dtype=dtype)
        del full
    return weights


def write_hf_folder(weights: dict[str, torch.Tensor], model, generation_config, tokenizer, out_dir: Path,
                    max_shard_bytes: int, dtype: torch.dtype, features: Features) -> None:
    """Write under a temporary name and swap it in: a failed export never leaves a half-written folder.

    `model` (its class and config; meta tensors do) gives the names the weights are saved under: those
    save_pretrained writes, transformers' load-time renaming undone (GPT-NeoX's lm_head is embed_out on disk),
    so that other readers of HF folders (vLLM, older transformers) find what they expect."""
    weights = revert_weight_conversion(model, weights)
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], partial / "model.safetensors", metadata={"format": "pt"})
    else:
        weight_map = {}
        for number, shard in enumerate(shards, start=1):
            filename = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, partial / filename, metadata={"format": "pt"})
            weight_map.update({name: filename for name in shard})
        total = sum(t.numel() * t.element_size() for t in weights.values())
        (partial / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config = copy.deepcopy(model.config)
    config.dtype = dtype
    config.save_pretrained(partial)
    if generation_config is not None:
        generation_config.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    features.export(partial, weights)
    replaced = out_dir.with_name(out_dir.name + ".replaced")
    shutil.rmtree(replaced, ignore_errors=True)
    if out_dir.exists():
        out_dir.rename(replaced)
    partial.rename(out_dir)
    shutil.rmtree(replaced, ignore_errors=True)


def export_trained(hf_model, tokenizer, out_dir: Path, checkpoint_cfg, state, features: Features) -> None:
    dtype = EXPORT_DTYPES[checkpoint_cfg.export_dtype]
    weights = gather_weights(hf_model, dtype, state.is_main)
    if state.is_main:
        write_hf_folder(weights, hf_model, hf_model.generation_config, tokenizer, out_dir,
                        parse_size(checkpoint_cfg.max_shard_size), dtype, features)
    state.barrier()


def export_checkpoint(checkpoint: Path, out_dir: Path, dtype_name: str | None, overwrite: bool) -> None:
    """Offline, one process: a DCP checkpoint (any world size) -> the same HF folder as the end of training.
    dtype_name None: the run's checkpoint.export_dtype."""
    check_complete(checkpoint)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise UserError(f"{out_dir}: exists and is not empty; choose another folder or pass --overwrite")
    saved = json.loads((checkpoint / "trainer_state.json").read_text())
    run = load_config(str(checkpoint / "config.yaml"), [], saved["task"], saved["world_size"])
    dtype_name = dtype_name or run.checkpoint.export_dtype
    if dtype_name not in EXPORT_DTYPES:
        raise UserError(f"--dtype: {dtype_name!r} is not one of {', '.join(EXPORT_DTYPES)}")
    source = checkpoint / "hf_config"
    config = AutoConfig.from_pretrained(source)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = {name: param.shape for name, param in model.named_parameters()}
    state = {f"model.hf_model.{name}": torch.empty(shape, dtype=torch.float32) for name, shape in names.items()}
    dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    dtype = EXPORT_DTYPES[dtype_name]
    weights = {name: state.pop(f"model.hf_model.{name}").to(dtype) for name in names}
    generation = GenerationConfig.from_pretrained(source) if (source / "generation_config.json").is_file() else None
    write_hf_folder(weights, model, generation, AutoTokenizer.from_pretrained(source), out_dir,
                    parse_size(run.checkpoint.max_shard_size), dtype, enabled_features(run))
