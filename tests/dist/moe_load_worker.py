"""Run by torchrun (2 processes) from test_moe_checkpoints.py: for each folder (a mixture-of-experts model saved by
save_pretrained, experts stored one by one), build the model as a run does, counting the bytes each rank reads
from the files; compare every loaded weight, gathered, with the one transformers' from_pretrained converts itself;
then export the loaded model, untrained, to OUT/NAME/hf. Each rank appends one JSON line per folder to
OUT/reports.jsonl."""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmtune.model import pretrained
from llmtune.checkpoint.hf_export import export_trained
from llmtune.config import load_config
from llmtune.features.base import Features
from llmtune.model.build import build_model, load_model_config
from llmtune.model.state import saved_tensors, whole
from llmtune.run.parallel import ParallelState
from llmtune.run.process_exit import run_and_exit


def counting_reads(tally: list[int]):
    read = pretrained.read_rows_into

    def counted(target, source, start):
        tally[0] += target.numel() * target.element_size()
        read(target, source, start)

    return counted


def report(folder: Path, recipe: str, out: Path, state: ParallelState) -> dict:
    config = load_config(recipe, [f"model.name_or_path={folder}"], "pt", state.world_size)
    tally = [0]
    pretrained.read_rows_into = counting_reads(tally)
    model = build_model(load_model_config(config.model), config.model, config.train, state, Features([]))
    converted = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    mismatched = [name for name, tensor in saved_tensors(model.hf_model).items()
                  if not torch.equal(whole(tensor).cpu(), converted[name])]
    export_trained(model, AutoTokenizer.from_pretrained(folder), out / folder.name, config.checkpoint, state,
                   Features([]))
    return {"rank": state.rank, "model": folder.name, "bytes_read": tally[0], "mismatched": mismatched}


def main() -> None:
    recipe, out, *folders = sys.argv[1:]
    state = ParallelState.initialize()
    try:
        reports = [report(Path(folder), recipe, Path(out), state) for folder in folders]
    finally:
        state.close()
    with open(Path(out) / "reports.jsonl", "a") as f:
        f.writelines(json.dumps(line) + "\n" for line in reports)


if __name__ == "__main__":
    run_and_exit(main)
