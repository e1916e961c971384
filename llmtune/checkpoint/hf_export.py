"""Write weights as a HF folder that AutoModelForCausalLM.from_pretrained loads: safetensors shards with
their index, config.json, generation_config.json and the tokenizer (with its chat template), plus the
files the run's features add.

Two sources share one writer: the FSDP model at the end of training, gathered to rank 0 one decoder layer at a
time, and a DCP checkpoint of any world size, offline (`llmtune export`: run/export.py). The writer saves each safetensors shard as soon as it is
full, so rank 0 holds at most one shard (max_shard_size) and one layer in the export dtype, never the whole model.
"""

import copy
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from transformers.core_model_loading import revert_weight_conversion

from llmtune.atomic import save_tensors, write_folder
from llmtune.config import parse_size
from llmtune.features.adapters import Adapters, merge_adapters
from llmtune.features.base import Features
from llmtune.model.build import decoder_layers, generation_defaults, reshard
from llmtune.model.multimodal import save_processor
from llmtune.model.state import saved_tensors, whole

EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def gather_weights(hf_model, dtype: torch.dtype, is_main: bool) -> Iterator[dict[str, torch.Tensor]]:
    """The weights as name -> full tensor in `dtype` on rank 0's CPU (empty dicts elsewhere), one decoder layer at
    a time (the weights outside the layers one by one): the unit in which transformers converts names and layouts
    back. Every rank must run the generator to its end: each gather takes part of all of them. Tied parameters
    appear once; persistent buffers (DeepSeek-V3's router bias) are saved with the parameters."""
    layer_modules = set(decoder_layers(hf_model))
    layers = {name + "." for name, module in hf_model.named_modules() if module in layer_modules}
    chunk, owner = {}, None
    for name, param in saved_tensors(hf_model).items():
        layer = next((prefix for prefix in layers if name.startswith(prefix)), name)
        if layer != owner and owner is not None:
            yield chunk
            chunk = {}
        owner = layer
        full = whole(param)
        if is_main:
            chunk[name] = full.to(device="cpu", dtype=dtype)
        del full
    yield chunk


def write_hf_folder(chunks: Iterable[dict[str, torch.Tensor]], model, generation_config, tokenizer, out_dir: Path,
                    max_shard_bytes: int, dtype: torch.dtype, features: Features) -> None:
    """`chunks`: the weights as gather_weights gives them. `model` (its class and config; meta tensors do) gives
    the names the weights are saved under: those save_pretrained writes, transformers' load-time renaming undone
    (GPT-NeoX's lm_head is embed_out on disk), so that other readers of HF folders (vLLM, older transformers) find
    what they expect."""

    def fill(partial: Path) -> None:
        shards: list[list[str]] = []  # the tensor names of each shard written, in order
        shard, size, total = {}, 0, 0

        def save() -> None:
            save_tensors(shard, partial / f"shard-{len(shards) + 1}", metadata={"format": "pt"})
            shards.append(list(shard))
            shard.clear()

        for chunk in chunks:
            for name, tensor in revert_weight_conversion(model, chunk).items():
                nbytes = tensor.numel() * tensor.element_size()
                if shard and size + nbytes > max_shard_bytes:
                    save()
                    size = 0
                shard[name] = tensor.contiguous()
                size, total = size + nbytes, total + nbytes
        save()
        if len(shards) == 1:
            (partial / "shard-1").rename(partial / "model.safetensors")
        else:
            weight_map = {}
            for number, names in enumerate(shards, start=1):
                filename = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
                (partial / f"shard-{number}").rename(partial / filename)
                weight_map.update({name: filename for name in names})
            (partial / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        config = copy.deepcopy(model.config)
        config.dtype = dtype
        config.save_pretrained(partial)
        if generation_config is not None:
            generation_config.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        save_processor(tokenizer, partial)
        features.export(partial, [name for names in shards for name in names])

    write_folder(out_dir, fill)


def export_trained(model, tokenizer, output_dir: Path, checkpoint_cfg, state, features: Features,
                   suffix: str = "") -> None:
    """output_dir/hf, the trained model (`model`: the training module, CausalLMForTraining); for an adapter run
    output_dir/adapter, and output_dir/hf with the adapters merged only when checkpoint.export_merged asks (merging
    changes the model: training is over). suffix: added to the folders' names (hf_ema, adapter_ema: a moving
    average's export). Weights a forward without backward left gathered (a probe, a callback's generation: the last
    layer and the root keep theirs after a forward) are freed first: a merge written into them would be dropped by
    FSDP with the gathered copy, and the export would read the unmerged shards."""
    reshard(model)
    hf_model = model.hf_model
    dtype = EXPORT_DTYPES[checkpoint_cfg.export_dtype]
    adapters = features.find(Adapters)
    if adapters:
        adapters.export_adapter(hf_model, tokenizer, output_dir / f"adapter{suffix}", dtype, state.is_main)
        if not checkpoint_cfg.export_merged:
            state.barrier()
            return
        merge_adapters(hf_model)
    chunks = gather_weights(hf_model, dtype, state.is_main)
    if state.is_main:
        write_hf_folder(chunks, hf_model, generation_defaults(hf_model), tokenizer, output_dir / f"hf{suffix}",
                        parse_size(checkpoint_cfg.max_shard_size), dtype, features)
    else:
        for _ in chunks:  # the gathers rank 0 is taking part in
            pass
    state.barrier()
