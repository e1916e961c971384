"""Where a run's weights come from, in one process: model.init_from (a new run from an llmtune checkpoint's
weights: step 0, a fresh optimizer and schedule; a checkpoint to resume from wins), an adapter checkpoint onto the
same base, and model.strict_load (a pretrained folder or a checkpoint that does not fit the model: refused, naming
the tensors, or loaded where it fits with the rest freshly initialised and named in one warning)."""

import logging

import pytest
import torch
import yaml
from safetensors.torch import load_file

from llmtune.config import load_config
from llmtune.features.adapters import peft_key
from llmtune.run.cli import main as cli_main
from llmtune.run.parallel import ParallelState
from llmtune.run.worker import build_trainer
from tests.helpers import cli_words, misfit_copy, read_metrics

pytestmark = pytest.mark.slow  # each test trains or builds several runs (~3 s each)


def recipe(root, name_or_path, sft_file, **sections) -> str:
    """root/recipe.yaml: a short sft run of the model in name_or_path writing to root/out; sections: extra keys per
    section."""
    content = {
        "model": {"name_or_path": str(name_or_path)},
        "data": {"train_files": [str(sft_file)], "chat_template": "basic", "max_seq_len": 64},
        "train": {"output_dir": str(root / "out"), "max_steps": 2, "per_device_train_batch_size": 2,
                  "logging_steps": 1, "learning_rate": 1e-3},
        "checkpoint": {"export_dtype": "fp32"},
    }
    for section, values in sections.items():
        content[section] = {**content.get(section, {}), **values}
    root.mkdir(parents=True, exist_ok=True)
    (root / "recipe.yaml").write_text(yaml.safe_dump(content))
    return str(root / "recipe.yaml")


def sft(path: str, *overrides: str) -> int:
    """The CLI in pytest's process: preflight checks, then the worker."""
    return cli_main(cli_words(["sft", path, *overrides]))


def built(path: str, *overrides: str):
    """(trainer, state) of a one-process run, built as the worker builds it (close the state after)."""
    config = load_config(path, list(overrides), "sft", world_size=1)
    state = ParallelState.initialize()
    return build_trainer(config, state)[0], state


@pytest.fixture(scope="module")
def first(tiny_model, sft_file, tmp_path_factory):
    """A run of 3 steps on tiny_model: its checkpoint at step 3 and its fp32 export of the same weights."""
    root = tmp_path_factory.mktemp("first")
    assert sft(recipe(root, tiny_model, sft_file, train={"max_steps": 3}, checkpoint={"save_steps": 3})) == 0
    return root / "out"


def test_init_from_starts_a_new_run_from_the_checkpoints_weights(first, tiny_model, sft_file, tmp_path, caplog):
    checkpoint = first / "checkpoints" / "global_step_3"
    started = recipe(tmp_path / "started", tiny_model, sft_file, model={"init_from": str(checkpoint)},
                     checkpoint={"save_steps": 1})
    assert sft(started) == 0
    # The same weights as a pretrained folder: a run that never saw a checkpoint.
    assert sft(recipe(tmp_path / "exported", first / "hf", sft_file)) == 0
    new, exported = read_metrics(tmp_path / "started" / "out"), read_metrics(tmp_path / "exported" / "out")
    assert [m["step"] for m in new] == [1, 2], "a new run: step 0, then its own steps"
    for ours, theirs in zip(new, exported, strict=True):
        # Same weights, a fresh optimizer and schedule: the same curve (fp32 CPU).
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
        assert ours["lr"] == theirs["lr"]
    assert new[0]["loss"] != pytest.approx(read_metrics(first)[0]["loss"], rel=1e-3), \
        "the first batch's loss is the checkpoint's weights', not tiny_model's"

    # Resumed, the run goes on from its own checkpoint: init_from is not read again.
    caplog.clear()
    assert sft(started, "train.max_steps=3", "checkpoint.resume_from_checkpoint=auto") == 0
    assert [m["step"] for m in read_metrics(tmp_path / "started" / "out")] == [1, 2, 3]
    assert "model.init_from is not read: the run goes on from" in caplog.text


def test_init_from_another_model_is_refused_naming_the_tensors_or_loaded_where_it_fits(first, tiny_qwen2, sft_file,
                                                                                       tmp_path, capsys, caplog):
    checkpoint = first / "checkpoints" / "global_step_3"
    path = recipe(tmp_path, tiny_qwen2, sft_file, model={"init_from": str(checkpoint)}, train={"max_steps": 1})
    assert sft(path) == 2
    message = capsys.readouterr().err
    assert "model.init_from:" in message and "6 missing from the source" in message
    assert "q_proj.bias" in message and "model.strict_load: false" in message
    assert not (tmp_path / "out" / "metrics.jsonl").exists(), "refused before any process starts"

    caplog.clear()
    trainer, state = built(path, "model.strict_load=false")
    try:
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "6 missing from the source" in warnings[0] and "q_proj.bias" in warnings[0]
        params = {name: param.full_tensor() for name, param in trainer.model.hf_model.named_parameters()}
        exported = load_file(first / "hf" / "model.safetensors")
        qwen2 = load_file(tiny_qwen2 / "model.safetensors")
        assert torch.equal(params["model.layers.0.self_attn.q_proj.weight"],
                           exported["model.layers.0.self_attn.q_proj.weight"])
        assert torch.equal(params["model.layers.0.self_attn.q_proj.bias"],
                           qwen2["model.layers.0.self_attn.q_proj.bias"].float()), "kept as the recipe's model has it"
    finally:
        state.close()


def test_an_adapter_checkpoint_starts_an_adapter_run_on_its_base_and_no_other(tiny_model, tied_llama, sft_file,
                                                                             tmp_path, capsys):
    lora = {"method": "lora", "r": 4, "target_modules": ["q_proj", "v_proj"]}
    assert sft(recipe(tmp_path / "adapters", tiny_model, sft_file, peft=lora, checkpoint={"save_steps": 2})) == 0
    checkpoint = tmp_path / "adapters" / "out" / "checkpoints" / "global_step_2"
    trained = load_file(tmp_path / "adapters" / "out" / "adapter" / "adapter_model.safetensors")
    path = recipe(tmp_path / "again", tiny_model, sft_file, peft=lora, model={"init_from": str(checkpoint)})
    trainer, state = built(path)
    try:
        adapters = {name: param.full_tensor() for name, param in trainer.model.hf_model.named_parameters()
                    if param.requires_grad}
        assert len(adapters) == 8
        for name, value in adapters.items():
            assert torch.equal(value, trained[peft_key(name)]), name
        assert trainer.step == 0
    finally:
        state.close()

    other_base = recipe(tmp_path / "other", tied_llama, sft_file, peft=lora, model={"init_from": str(checkpoint)})
    assert sft(other_base) == 2
    message = capsys.readouterr().err
    assert "model.init_from:" in message and "holds only the trained parameters of a run on" in message
    assert "set model.name_or_path (or model.config) to the model it was trained on" in message


@pytest.fixture(scope="module")
def misfit(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("misfit")
    return folder, misfit_copy(tiny_model, folder)


def test_strict_load_refuses_a_misfit_folder_and_lenient_load_initialises_what_it_lacks(misfit, sft_file, tmp_path,
                                                                                       capsys, caplog):
    folder, stored = misfit
    path = recipe(tmp_path, folder, sft_file, train={"max_steps": 1})
    assert sft(path) == 2
    message = capsys.readouterr().err
    assert "lacks weights for model.layers.0.mlp.down_proj.weight, model.norm.weight" in message
    assert "holds lm_head.weight in shape [252, 32] but the config gives [256, 32]" in message

    caplog.clear()
    trainer, state = built(path, "model.strict_load=false")
    try:
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        for part in ("2 missing from the source (model.layers.0.mlp.down_proj.weight, model.norm.weight)",
                     "1 of another shape (lm_head.weight)", "1 not in the model (model.extra.weight)"):
            assert part in warnings[0]
        params = {name: param.full_tensor() for name, param in trainer.model.hf_model.named_parameters()}
        fresh = ("model.layers.0.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight")
        for name, value in params.items():
            if name not in fresh:
                assert torch.equal(value, stored[name].float()), name
        # transformers' own initialisation: normal(0, initializer_range) for linear layers, ones for norms.
        assert torch.equal(params["model.norm.weight"], torch.ones(32))
        for name in ("model.layers.0.mlp.down_proj.weight", "lm_head.weight"):
            assert params[name].std().item() == pytest.approx(0.02, rel=0.15) and params[name].abs().max() > 0
        assert params["lm_head.weight"].shape == (256, 32)
        trainer.train()
        assert [m["step"] for m in read_metrics(tmp_path / "out")] == [1]
    finally:
        state.close()
