"""Adapters and frozen modules on FSDP2 (fp32, sft on packed rows of 96 tokens, a global batch of 4 rows, chunked
loss in 32-token chunks), 2-process runs in one torchrun launch against one-process references in this process:
- LoRA, DoRA and frozen-module runs: (1 process, accumulation 2) = (2 processes, accumulation 1), losses to 1e-5
  relative, trained weights to 1e-5 absolute; LoRA with cp=2 and activation checkpointing = cp=1;
- LoRA resumes bitwise from its checkpoint (after SIGKILL too) and on one process to 1e-5; its checkpoint holds the
  adapters alone, and a checkpoint is refused on a base model with other weights;
- the adapter folder, loaded by peft on the base, and the merged folder, loaded by transformers, give the trained
  model's logits (1e-5), as does a run that continues from the adapter folder; a tied lm_head trained through
  modules_to_save included; the offline export writes the same folders (`llmtune export`, in this process: it is one
  process, which a launch would only add its start-up to).
"""

import json
import time

import pytest
import torch
import yaml
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from llmtune.checkpoint.validate import saved_model_shapes
from llmtune.config import load_config
from llmtune.errors import UserError
from llmtune.features.adapters import lora_layers
from llmtune.run.cli import main as cli_main
from llmtune.run.parallel import ParallelState
from llmtune.run.worker import build_trainer
from tests.dist.case_worker import run_case
from tests.helpers import kill_tree, launch_cases, read_metrics, run_cli, save_tiny_model, start_cli

PROBE = "The sum of 12 and 30 is 42. 7 + 8 = 15."
LORA = {"method": "lora", "r": 4, "alpha": 8, "init_lora_weights": False}


def write_recipe(path, model, data, peft=None, train=None) -> str:
    """init_lora_weights false: B starts random, so that both adapter matrices have gradients from step 1."""
    path.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(model)},
        "data": {"train_files": [str(data)], "max_seq_len": 96, "chat_template": "basic"},
        "train": {"max_steps": 4, "per_device_train_batch_size": 2, "global_batch_size": 4, "logging_steps": 1,
                  "learning_rate": 5e-3, "chunk_loss_size": 32, **(train or {})},
        "peft": peft or {},
        "checkpoint": {"export_dtype": "fp32", "export_merged": True, "save_steps": 2},
        "monitor": {"console": False},
    }))
    return str(path)


@pytest.fixture(scope="module")
def runs(tiny_model, tied_llama, bare_tokenizer, sft_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    probe = bare_tokenizer(PROBE)["input_ids"]
    recipes = {
        "lora": write_recipe(root / "lora.yaml", tiny_model, sft_file, LORA),
        "dora": write_recipe(root / "dora.yaml", tiny_model, sft_file, {**LORA, "method": "dora"}),
        "frozen": write_recipe(root / "frozen.yaml", tiny_model, sft_file, None, {
            "trainable_modules": [r"self_attn\.", "lm_head"], "frozen_modules": [r"layers\.0\."]}),
        "tied": write_recipe(root / "tied.yaml", tied_llama, sft_file, {**LORA, "modules_to_save": ["embed_tokens"]}),
    }
    out = {name: root / name for name in
           ("lora", "lora_resumed", "lora_cp2", "dora", "frozen", "tied", "lora_ref", "dora_ref", "frozen_ref",
            "lora_resumed_on_1", "continued", "killed")}
    step_2 = out["lora"] / "checkpoints" / "global_step_2"
    cases = [{"recipe": recipes["lora"], "overrides": [f"train.output_dir={out['lora']}"], "probe": probe},
             {"recipe": recipes["lora"], "overrides": [f"train.output_dir={out['lora_resumed']}",
                                                       f"checkpoint.resume_from_checkpoint={step_2}"]},
             {"recipe": recipes["lora"], "overrides": [f"train.output_dir={out['lora_cp2']}", "parallel.cp_size=2",
                                                       "train.gradient_checkpointing=true"]},
             *[{"recipe": recipes[name], "overrides": [f"train.output_dir={out[name]}"], "probe": probe}
               for name in ("dora", "frozen", "tied")]]
    launch_cases(cases, root)
    for name in ("lora", "dora", "frozen"):
        run_case(recipes[name], [f"train.output_dir={out[name + '_ref']}"], 1)
    run_case(recipes["lora"], [f"train.output_dir={out['lora_resumed_on_1']}",
                               f"checkpoint.resume_from_checkpoint={step_2}"], 1)
    run_case(recipes["lora"], [f"train.output_dir={out['continued']}", f"peft.adapter_path={out['lora'] / 'adapter'}",
                               "train.learning_rate=0", "train.max_steps=1"], 1, probe=probe)
    out["recipes"] = recipes
    return out


def losses(output_dir) -> list[float]:
    return [record["loss"] for record in read_metrics(output_dir)]


def adapter(output_dir) -> dict[str, torch.Tensor]:
    return load_file(output_dir / "adapter" / "adapter_model.safetensors")


def close(actual: dict, expected: dict, atol: float) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=atol, msg=name)


def probe_logits(model, tokenizer) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokenizer(PROBE)["input_ids"]])).logits


@pytest.mark.parametrize("name", ["lora", "dora", "frozen"])
def test_one_process_with_accumulation_equals_two_processes(runs, name):
    assert len(losses(runs[name])) == 4
    assert losses(runs[name + "_ref"]) == pytest.approx(losses(runs[name]), rel=1e-5)
    assert losses(runs[name])[-1] < losses(runs[name])[0], "it learns"
    if name == "frozen":
        close(load_file(runs[name + "_ref"] / "hf" / "model.safetensors"),
              load_file(runs[name] / "hf" / "model.safetensors"), 1e-5)
    else:
        close(adapter(runs[name + "_ref"]), adapter(runs[name]), 1e-5)


def test_context_parallel_with_activation_checkpointing_gives_the_same_losses(runs):
    assert losses(runs["lora_cp2"]) == pytest.approx(losses(runs["lora"]), rel=1e-5)
    close(adapter(runs["lora_cp2"]), adapter(runs["lora"]), 1e-5)


def test_checkpoint_holds_the_adapters_and_resumes_bitwise(runs):
    saved = saved_model_shapes(runs["lora"] / "checkpoints" / "global_step_2")
    assert saved and all(".lora_A." in name or ".lora_B." in name for name in saved)
    assert len(saved) == 2 * 7 * 2, "A and B of the 7 linear layers of 2 decoder layers"
    assert [m["step"] for m in read_metrics(runs["lora_resumed"])] == [3, 4]
    assert losses(runs["lora_resumed"]) == losses(runs["lora"])[2:]
    resumed, straight = adapter(runs["lora_resumed"]), adapter(runs["lora"])
    assert all(torch.equal(resumed[key], straight[key]) for key in straight)
    assert losses(runs["lora_resumed_on_1"]) == pytest.approx(losses(runs["lora"])[2:], rel=1e-5)


def test_frozen_modules_keep_their_weights(runs, tiny_model):
    base = load_file(tiny_model / "model.safetensors")
    trained = load_file(runs["frozen"] / "hf" / "model.safetensors")
    changed = {name for name in base if not torch.equal(base[name], trained[name])}
    assert changed == {name for name in base
                       if ("self_attn." in name and "layers.0." not in name) or name == "lm_head.weight"}


@pytest.mark.parametrize("name", ["lora", "dora", "tied"])
def test_adapter_and_merged_folders_give_the_trained_logits(runs, name, bare_tokenizer):
    trained = torch.load(runs[name] / "logits.pt")
    config = json.loads((runs[name] / "adapter" / "adapter_config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, runs[name] / "adapter")
    torch.testing.assert_close(probe_logits(with_adapter, bare_tokenizer), trained, rtol=0, atol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(runs[name] / "hf", dtype=torch.float32)
    assert not any("lora" in key for key in load_file(runs[name] / "hf" / "model.safetensors"))
    torch.testing.assert_close(probe_logits(merged, bare_tokenizer), trained, rtol=0, atol=1e-5)


def test_tied_embeddings_trained_through_modules_to_save_are_saved_under_both_names(runs, tied_llama):
    config = json.loads((runs["tied"] / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["modules_to_save"]) == ["lm_head", "model.embed_tokens"]
    saved = adapter(runs["tied"])
    embeddings = saved["base_model.model.model.embed_tokens.weight"]
    assert torch.equal(embeddings, saved["base_model.model.lm_head.weight"])
    assert not torch.equal(embeddings, load_file(tied_llama / "model.safetensors")["model.embed_tokens.weight"])


def test_a_run_continues_from_the_adapter_folder(runs):
    assert json.loads((runs["continued"] / "adapter" / "adapter_config.json").read_text())["r"] == LORA["r"]
    torch.testing.assert_close(torch.load(runs["continued"] / "logits.pt"), torch.load(runs["lora"] / "logits.pt"),
                               rtol=0, atol=1e-5)


def test_offline_export_writes_the_same_folders(runs, tmp_path):
    last = runs["lora"] / "checkpoints" / "global_step_4"
    assert cli_main(["export", str(last), str(tmp_path / "adapter")]) == 0
    close(load_file(tmp_path / "adapter" / "adapter_model.safetensors"), adapter(runs["lora"]), 0)
    assert cli_main(["export", str(last), str(tmp_path / "merged"), "--merge"]) == 0
    close(load_file(tmp_path / "merged" / "model.safetensors"), load_file(runs["lora"] / "hf" / "model.safetensors"),
          1e-6)


def test_offline_export_of_frozen_modules_rereads_the_base(runs, tmp_path, capsys):
    last = runs["frozen"] / "checkpoints" / "global_step_4"
    assert cli_main(["export", str(last), str(tmp_path / "hf")]) == 0
    close(load_file(tmp_path / "hf" / "model.safetensors"), load_file(runs["frozen"] / "hf" / "model.safetensors"), 0)
    assert cli_main(["export", str(last), str(tmp_path / "merged"), "--merge"]) == 2
    error = capsys.readouterr().err
    assert "--merge: " in error and "has no adapters" in error
    assert not (tmp_path / "merged").exists()


def test_a_checkpoint_is_refused_on_a_base_with_other_weights(runs, bare_tokenizer, tmp_path):
    other = save_tiny_model(tmp_path / "other", LlamaForCausalLM, bare_tokenizer, seed=5, num_key_value_heads=2,
                            tie_word_embeddings=False)
    step_2 = runs["lora"] / "checkpoints" / "global_step_2"
    with pytest.raises(UserError, match="has other weights") as error:
        run_case(runs["recipes"]["lora"], [f"train.output_dir={tmp_path / 'out'}", f"model.name_or_path={other}",
                                           f"checkpoint.resume_from_checkpoint={step_2}"], 1)
    assert "\n" not in str(error.value)


def test_dora_magnitudes_start_as_the_norms_of_the_adapted_weights(runs, tmp_path):
    """As peft sets them: the row norms of W + s BA, here with B random (init_lora_weights false)."""
    config = load_config(runs["recipes"]["dora"], [f"train.output_dir={tmp_path}"], "sft", 1)
    state = ParallelState.initialize()
    try:
        trainer, _ = build_trainer(config, state)
        layers = lora_layers(trainer.model.hf_model)
        assert len(layers) == 14
        for layer in layers.values():
            adapted = (layer.base_layer.weight.full_tensor() + layer.scaling["default"]
                       * layer.lora_B["default"].weight.full_tensor() @ layer.lora_A["default"].weight.full_tensor())
            torch.testing.assert_close(layer.lora_magnitude_vector["default"].weight.full_tensor(),
                                       torch.linalg.vector_norm(adapted, dim=1), rtol=1e-6, atol=0)
    finally:
        state.close()


def test_under_bf16_the_frozen_base_is_stored_in_bf16_and_only_the_adapters_are_optimized(runs, tmp_path):
    config = load_config(runs["recipes"]["lora"], [f"train.output_dir={tmp_path}", "train.bf16=true",
                                                   "train.max_steps=2", "checkpoint.save_steps=0"], "sft", 1)
    state = ParallelState.initialize()
    try:
        trainer, _ = build_trainer(config, state)
        dtypes = {name: param.dtype for name, param in trainer.model.hf_model.named_parameters()}
        optimized = {id(param) for group in trainer.optimizer.param_groups for param in group["params"]}
        trained = {id(param) for name, param in trainer.model.hf_model.named_parameters() if ".lora_" in name}
        trainer.train()
    finally:
        state.close()
    assert {dtypes[name] for name in dtypes if ".lora_" in name} == {torch.float32}
    assert {dtypes[name] for name in dtypes if ".lora_" not in name} == {torch.bfloat16}
    assert optimized == trained, "only the adapters reach AdamW"
    assert all(torch.isfinite(torch.tensor(losses(tmp_path))))


def test_killed_lora_run_resumes_bitwise(runs):
    """SIGKILL once step 3 is logged (the step-2 checkpoint is complete), resume from latest."""
    output_dir, args = runs["killed"], ["sft", runs["recipes"]["lora"], f"train.output_dir={runs['killed']}",
                                        "--nproc", "2"]
    process = start_cli(*args)
    deadline = time.monotonic() + 300
    while not ((output_dir / "metrics.jsonl").is_file() and len(read_metrics(output_dir)) >= 3):
        assert process.poll() is None and time.monotonic() < deadline, "the run ended or hung before the kill"
        time.sleep(0.01)
    kill_tree(process)
    result = run_cli(*args, "--resume_from_checkpoint", "latest")
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses(output_dir) == losses(runs["lora"])
    resumed, straight = adapter(output_dir), adapter(runs["lora"])
    assert all(torch.equal(resumed[key], straight[key]) for key in straight)
