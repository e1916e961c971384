"""pt from scratch (tied embeddings), in this process: the exported HF folder loads with from_pretrained and
gives the trained model's logits; the run writes its resolved config and metrics. Every exported file (the HF folder
and the adapter folder) has the permissions the umask gives."""

import dataclasses
import json
import os
import stat

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmtune.checkpoint.hf_export import export_trained
from llmtune.config import load_config
from llmtune.run.parallel import ParallelState
from llmtune.run.worker import build_trainer
from tests.helpers import read_metrics, run_cli_imports, train_and_export


@pytest.fixture(scope="module")
def trained(assets, tmp_path_factory):
    """(output_dir, logits of the trained FSDP model on a fixed input, that input)."""
    output_dir = tmp_path_factory.mktemp("pt")
    recipe = output_dir / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"config": str(assets / "model"), "tokenizer": str(assets / "tokenizer")},
        "data": {"train_files": [str(assets / "data" / "pt.jsonl")], "max_seq_len": 64,
                 "cache_dir": str(output_dir / "cache")},
        "train": {"output_dir": str(output_dir), "max_steps": 3, "per_device_train_batch_size": 4,
                  "learning_rate": 1e-2, "logging_steps": 2},
        "checkpoint": {"export_dtype": "fp32", "max_shard_size": "200KB"},
    }))
    config = load_config(str(recipe), [], "pt", world_size=1)

    def bf16_export_and_logits(trainer, tokenizer, state):
        bf16 = dataclasses.replace(config.checkpoint, export_dtype="bf16", max_shard_size="5GB")
        export_trained(trainer.model, tokenizer, output_dir / "bf16", bf16, state, trainer.features)
        input_ids = torch.tensor([tokenizer("The sum of 12 and 30 is 42. 7 + 8 = 15.")["input_ids"]])
        trainer.model.eval()
        with torch.no_grad():
            return trainer.model(input_ids.to(state.device)).cpu(), input_ids

    logits, input_ids = train_and_export(config, bf16_export_and_logits)
    return output_dir, logits, input_ids


def test_exported_folder_gives_the_trained_logits(trained, assets):
    output_dir, logits, input_ids = trained
    index = json.loads((output_dir / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "200KB shards: the export is split"
    assert "lm_head.weight" not in index["weight_map"], "tied weights are written once"
    model = AutoModelForCausalLM.from_pretrained(output_dir / "hf", dtype=torch.float32)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, logits, rtol=0, atol=1e-5)
    tokenizer = AutoTokenizer.from_pretrained(output_dir / "hf")
    assert tokenizer("7 + 8")["input_ids"] == AutoTokenizer.from_pretrained(assets / "tokenizer")("7 + 8")["input_ids"]


def test_bf16_export_is_within_bf16_rounding(trained):
    output_dir, logits, input_ids = trained
    assert (output_dir / "bf16" / "hf" / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(output_dir / "bf16" / "hf")
    assert model.dtype == torch.bfloat16
    with torch.no_grad():
        exported = model.float()(input_ids).logits
    torch.testing.assert_close(exported, logits, rtol=0, atol=0.05 * logits.abs().max().item())
    assert not torch.equal(exported, logits)


def test_run_writes_resolved_config_and_metrics(trained):
    output_dir, _, _ = trained
    resolved = yaml.safe_load((output_dir / "config.yaml").read_text())
    assert resolved["train"]["max_steps"] == 3 and resolved["train"]["learning_rate"] == 1e-2
    assert resolved["data"]["format"] == "auto"
    assert [m["step"] for m in read_metrics(output_dir)] == [2, 3]


def test_every_exported_file_has_the_umasks_permissions(tiny_model, sft_file, tmp_path):
    """safetensors writes its files readable by their owner alone; a model shared on a cluster must not be."""
    recipe = {"model": {"name_or_path": str(tiny_model)},
              "data": {"train_files": [str(sft_file)], "chat_template": "basic", "max_seq_len": 64},
              "train": {"output_dir": str(tmp_path), "per_device_train_batch_size": 2},
              "peft": {"method": "lora", "r": 4}, "checkpoint": {"export_merged": True}}
    config = load_config(recipe, [], "sft", world_size=1)
    state = ParallelState.initialize()
    previous = os.umask(0o022)
    try:
        trainer, tokenizer = build_trainer(config, state)
        export_trained(trainer.model, tokenizer, tmp_path, config.checkpoint, state, trainer.features)
    finally:
        os.umask(previous)
        state.close()
    modes = {path.relative_to(tmp_path): stat.S_IMODE(path.stat().st_mode)
             for folder in ("hf", "adapter") for path in (tmp_path / folder).iterdir()}
    assert {"hf/model.safetensors", "adapter/adapter_model.safetensors"} <= {str(path) for path in modes}
    assert {str(path): oct(mode) for path, mode in modes.items() if mode != 0o644} == {}


def test_a_missing_checkpoint_folder_is_refused_before_torch_is_imported(tmp_path):
    """The refusal came after torch, transformers and the rest were imported: seconds (half a minute on a cold
    start) for one line."""
    result, imported = run_cli_imports("export", str(tmp_path / "missing"), str(tmp_path / "out"))
    assert (result.returncode, result.stdout, result.stderr) == (
        2, "", f"llmtune: error: {tmp_path / 'missing'}: no such checkpoint folder\n")
    assert "llmtune" in imported, "the report lists the imports"
    assert "torch" not in imported
    assert not (tmp_path / "out").exists()
