"""What an HF Trainer user types works: --version, pt|sft --help listing every recipe key, flat --key VALUE
overrides (and their errors), the HF names of keys and schedules read as llmtune's, with llmtune's in config.yaml."""

import dataclasses
import importlib.metadata
import subprocess
from pathlib import Path

import pytest
import yaml

from llmtune import config as config_module
from llmtune.run import cli
from llmtune.config import KEY_ALIASES, key_names, load_config, parse_overrides, recipe_keys, task_sections
from llmtune.errors import UserError
from tests.helpers import REPO
from tests.unit.test_config import write_recipe


def test_version_is_the_installed_packages():
    result = subprocess.run([str(REPO / "bin" / "llmtune"), "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert result.stdout.strip() == f"llmtune {importlib.metadata.version('llmtune')}"


@pytest.mark.parametrize("task, words, counted", [
    ("sft", "Supervised fine-tuning", "count samples; with data.packing (llmtune's default) rows"),
    ("pt", "Pre-training", "count rows of data.max_seq_len tokens"),
    ("dpo", "Preference training", "count pairs (a prompt with its chosen and rejected responses), as TRL and "
                                   "LLaMA-Factory count them"),
    ("kto", "KTO: prompts", "count examples (a prompt with its response), as TRL and LLaMA-Factory count them")])
def test_help_lists_every_recipe_key_with_its_default_and_help(task, words, counted, capsys):
    assert cli.main([task, "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: llmtune {task} RECIPE") and words in text
    flat = " ".join(text.split())  # the help is wrapped
    assert f"per_device_train_batch_size and global_batch_size {counted}" in flat
    names = key_names(task)
    for section, key, default, help in recipe_keys(task_sections(task)):
        option = key if len(names[key]) == 1 else f"{section}.{key}"
        assert f"--{option} (default: {default})" in text, key
        assert " ".join(help.split()) in flat, key
    for section in ("dpo", "kto"):
        assert (f"{section}:" in text.splitlines()) == (task == section), "a task's help lists its own section alone"
    for alias, target in KEY_ALIASES.items():
        listed = f"{alias} (--{alias.partition('.')[2]}) = {target}" in text
        assert listed == (target.partition(".")[0] in task_sections(task)), alias


def test_the_usage_gives_every_commands_options(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "llmtune demo [--nproc N] [section.key=VALUE ...]" in capsys.readouterr().out


@pytest.mark.parametrize("command, last", [("demo", "[section.key=VALUE ...]"), ("data", "[section.key=value ...]"),
                                           ("plan", "\n               [section.key=VALUE ...]"),
                                           ("train", "a LLaMA-Factory recipe: the task is its stage")])
def test_the_commands_without_recipe_keys_answer_help_with_their_usage(command, last, capsys):
    assert cli.main([command, "--help"]) == 0
    usage, what = capsys.readouterr().out.split("\n\n")
    assert usage.startswith(f"usage: llmtune {command} ") and usage.endswith(last) and what.strip()


def test_beta_speaks_of_orpo_in_dpo_alone():
    helps = {section: help for section, key, _, help in recipe_keys() if key == "beta"}
    assert "orpo" in helps["dpo"] and "orpo" not in helps["kto"], "orpo is a dpo.loss_type"


def test_flat_keys_name_their_section(tmp_path):
    overrides, nproc = parse_overrides(["--learning_rate", "2e-5", "max_steps=3", "--cp_size=2", "--nproc", "2",
                                        "--resume_from_checkpoint", "auto", "data.max_seq_len=128"])
    assert overrides == ["train.learning_rate=2e-5", "train.max_steps=3", "parallel.cp_size=2",
                         "checkpoint.resume_from_checkpoint=auto", "data.max_seq_len=128"]
    config = load_config(write_recipe(tmp_path), overrides, "sft", nproc)
    assert (config.train.learning_rate, config.train.max_steps, config.parallel.cp_size) == (2e-5, 3, 2)


def test_a_key_in_several_sections_must_be_written_with_its_section(monkeypatch):
    @dataclasses.dataclass
    class Other:
        seed: int = 0

    monkeypatch.setitem(config_module.SECTIONS, "other", Other)
    with pytest.raises(UserError) as err:
        parse_overrides(["--seed", "3"])
    assert str(err.value) == ("--seed: several sections have this key (other.seed, train.seed); write it with its "
                              "section, e.g. --other.seed")
    assert parse_overrides(["--train.seed", "3"]) == (["train.seed=3"], None)


@pytest.mark.parametrize("typed, hint", [("learnig_rate", "did you mean --learning_rate?"),
                                         ("max_step", "did you mean --max_steps or --max_eval_steps or --save_steps?"),
                                         ("zzz", "see llmtune sft --help")])
def test_a_misspelt_flat_key_gets_the_closest_names(typed, hint):
    with pytest.raises(UserError) as err:
        parse_overrides([f"--{typed}", "1"])
    assert str(err.value).startswith(f"--{typed}: no recipe key has this name; {hint}")


@pytest.mark.parametrize("alias, target, value", [
    ("train.torch_compile", "train.compile", True),
    ("train.label_smoothing_factor", "train.label_smoothing", 0.1),
    ("train.full_determinism", "train.deterministic", True),
    ("train.min_lr_rate", "train.min_lr_ratio", 0.1),
    ("train.num_decay_steps", "train.decay_steps", 20.0),
    ("train.report_to", "monitor.report_to", ["tensorboard"]),
    ("train.run_name", "monitor.run_name", "first-try"),
    ("monitor.wandb_project", "monitor.project", "chat-models"),
    ("train.dataloader_num_workers", "data.num_workers", 2),
    ("train.dataloader_pin_memory", "data.pin_memory", False),
    ("model.model_name_or_path", "model.name_or_path", "other/model"),
    ("data.cutoff_len", "data.max_seq_len", 1024),
    ("train.lr", "train.learning_rate", 2e-5),
    ("peft.finetuning_type", "peft.method", "lora"),
    ("peft.lora_rank", "peft.r", 8),
    ("peft.lora_alpha", "peft.alpha", 16.0),
    ("peft.lora_dropout", "peft.dropout", 0.05),
    ("peft.lora_target", "peft.target_modules", "q_proj"),
])
@pytest.mark.parametrize("where", ["recipe", "command line"])
def test_hf_key_names_are_read_as_llmtunes_and_written_as_llmtunes(tmp_path, alias, target, value, where):
    assert set(KEY_ALIASES.items()) >= {(alias, target)}
    section, key = alias.split(".")
    if where == "recipe":
        recipe, overrides = write_recipe(tmp_path, **{section: {key: value}}), []
        if target == f"{section}.name_or_path":  # the base recipe's own model.name_or_path gives way
            written = yaml.safe_load(Path(recipe).read_text())
            del written[section]["name_or_path"]
            Path(recipe).write_text(yaml.safe_dump(written))
    else:
        recipe, overrides = write_recipe(tmp_path), parse_overrides([f"--{key}", yaml.safe_dump(value).strip()
                                                                      .removesuffix("...").strip()])[0]
    config = load_config(recipe, overrides, "sft", 1)
    target_section, target_key = target.split(".")
    assert getattr(getattr(config, target_section), target_key) == value
    config.write(tmp_path / "config.yaml")
    written = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert written[target_section][target_key] == value and key not in written[section]
    assert load_config(str(tmp_path / "config.yaml"), [], "sft", 1) == config


def test_hf_dataloader_names_are_read_as_llmtunes_data_keys(tmp_path):
    """prefetch_factor and persistent_workers need workers (test_config), so the four are given together."""
    hf = {"dataloader_num_workers": 2, "dataloader_pin_memory": False, "dataloader_prefetch_factor": 4,
          "dataloader_persistent_workers": True}
    assert {f"train.{key}" for key in hf} <= set(KEY_ALIASES)
    config = load_config(write_recipe(tmp_path, train=hf), [], "sft", 1)
    expected = {"num_workers": 2, "pin_memory": False, "prefetch_factor": 4, "persistent_workers": True}
    assert {key: getattr(config.data, key) for key in expected} == expected
    config.write(tmp_path / "config.yaml")
    written = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert expected.items() <= written["data"].items() and not hf.keys() & written["train"].keys()


@pytest.mark.parametrize("train, expected", [
    ({"lr_scheduler_type": "constant_with_warmup"}, {"lr_scheduler_type": "constant"}),
    ({"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.1}},
     {"lr_scheduler_type": "cosine", "min_lr_ratio": 0.1}),
    ({"lr_scheduler_type": "warmup_stable_decay",
      "lr_scheduler_kwargs": {"num_decay_steps": 30, "decay_type": "linear"}},
     {"lr_scheduler_type": "wsd", "decay_steps": 30, "decay_type": "linear"}),
    ({"warmup_steps": 0.05}, {"warmup_ratio": 0.05, "warmup_steps": 0}),
    ({"warmup_steps": 10}, {"warmup_ratio": 0.0, "warmup_steps": 10}),
])
def test_hf_schedule_names_and_warmup_fraction(tmp_path, train, expected):
    config = load_config(write_recipe(tmp_path, train=train), [], "sft", 1)
    assert {key: getattr(config.train, key) for key in expected} == expected


@pytest.mark.parametrize("value", ["none", ["none"], []])
def test_report_to_none_is_no_tracker(tmp_path, value):
    assert load_config(write_recipe(tmp_path, monitor={"report_to": value}), [], "sft", 1).monitor.report_to == []


def test_an_hf_name_and_llmtunes_with_different_values_are_refused(tmp_path):
    recipe = write_recipe(tmp_path, train={"torch_compile": True, "compile": False, "warmup_steps": 0.1,
                                           "warmup_ratio": 0.2}, peft={"lora_target": "all",
                                                                       "target_modules": "all-linear"})
    with pytest.raises(UserError) as err:
        load_config(recipe, [], "sft", 1)
    assert str(err.value).splitlines() == [
        f"{recipe}: train.torch_compile is the HF Trainer's name for train.compile, which is also given with another "
        "value; keep one",
        f"{recipe}: peft.lora_target is LLaMA-Factory's name for peft.target_modules, which is also given with "
        "another value; keep one",
        f"{recipe}: train.warmup_steps 0.1 is a ratio, and train.warmup_ratio is also given with another value; "
        "keep one"]


@pytest.mark.parametrize("recipe_keys, override, key, value", [
    ({"peft": {"lora_target": "all"}}, "peft.target_modules=all-linear", "peft.target_modules", "all-linear"),
    ({"peft": {"target_modules": ["q_proj"]}}, "peft.lora_target=v_proj", "peft.target_modules", "v_proj"),
    ({"train": {"report_to": "tensorboard"}}, "monitor.report_to=wandb", "monitor.report_to", ["wandb"]),
    ({"train": {"lr_scheduler_kwargs": {"min_lr_rate": 0.1}}}, "train.min_lr_ratio=0.2", "train.min_lr_ratio", 0.2),
])
def test_an_override_wins_over_the_recipes_value_under_another_name(tmp_path, recipe_keys, override, key, value):
    config = load_config(write_recipe(tmp_path, **recipe_keys), [override, "peft.method=lora"], "sft", 1)
    section, name = key.split(".")
    assert getattr(getattr(config, section), name) == value


@pytest.mark.parametrize("given, method", [("full", "none"), ("lora", "lora")])
def test_llama_factory_finetuning_types_are_peft_methods(tmp_path, given, method):
    overrides, _ = parse_overrides(["--finetuning_type", given])
    assert load_config(write_recipe(tmp_path), overrides, "sft", 1).peft.method == method


def test_llama_factory_freeze_is_llmtunes_trainable_layers(tmp_path):
    """finetuning_type freeze in a sectioned recipe too: the last two layers (LLaMA-Factory's freeze_trainable_layers
    where it is left out), no adapters."""
    config = load_config(write_recipe(tmp_path), parse_overrides(["--finetuning_type", "freeze"])[0], "sft", 1)
    assert (config.peft.method, config.train.trainable_layers) == ("none", 2)


def test_a_global_batch_on_the_command_line_replaces_the_recipes_accumulation(tmp_path):
    recipe = write_recipe(tmp_path, train={"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4})
    config = load_config(recipe, parse_overrides(["--global_batch_size", "32"])[0], "sft", 2)
    assert (config.train.global_batch_size, config.train.gradient_accumulation_steps) == (32, 8)
    # Both in the recipe, disagreeing, are still refused: nothing says which is meant.
    both = write_recipe(tmp_path, train={"per_device_train_batch_size": 2, "global_batch_size": 32,
                                         "gradient_accumulation_steps": 2})
    with pytest.raises(UserError, match="set only one of them"):
        load_config(both, [], "sft", 2)
