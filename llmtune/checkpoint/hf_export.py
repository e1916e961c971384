"""Write the trained weights as a HF folder that AutoModelForCausalLM.from_pretrained loads."""

import shutil
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM

PREFIX = "hf_model."


def export_hf(model, tokenizer, out_dir: Path, state) -> None:
    """Gather the full state dict to rank 0's CPU and save it with config and tokenizer.

    Every rank takes part in the gather; only rank 0 writes. The folder is written under a
    temporary name and renamed when complete, so a crash never leaves a half-written export.
    """
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if state.is_main:
        hf_model = model.hf_model
        weights = {k.removeprefix(PREFIX): v for k, v in full.items()}
        # Built on the meta device and given the gathered tensors: no second copy of the weights.
        with torch.device("meta"):
            export = AutoModelForCausalLM.from_config(hf_model.config)
        export.load_state_dict(weights, assign=True)
        export.tie_weights()
        export.generation_config = hf_model.generation_config
        partial = out_dir.with_name(out_dir.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        export.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        shutil.rmtree(out_dir, ignore_errors=True)
        partial.rename(out_dir)
    state.barrier()
