"""LLaMA-Factory's flat recipes read as llmtune's: every key placed in its section or refused in one line with its
reason, LLaMA-Factory's defaults where the recipe leaves out a key whose default there trains another model (a
sectioned recipe keeps llmtune's), the task from the stage. The recipes are LLaMA-Factory's own examples
(examples/train_lora/qwen3_lora_{sft,dpo,kto}.yaml), written here from their published text."""

import pytest
import yaml

from llmtune.config import load_config
from llmtune.errors import UserError
from llmtune.llamafactory import REFUSED
from llmtune.run.cli import main

# examples/train_lora/qwen3_lora_sft.yaml as LLaMA-Factory publishes it (its commented-out eval lines left out).
QWEN3_LORA_SFT = """\
### model
model_name_or_path: Qwen/Qwen3-4B-Instruct-2507
trust_remote_code: true

### method
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all

### dataset
dataset: identity
template: qwen3_nothink
cutoff_len: 2048
max_samples: 1000
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: saves/qwen3-4b/lora/sft
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none  # choices: [none, wandb, tensorboard, swanlab, mlflow]

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null
"""
# qwen3_lora_dpo.yaml and qwen3_lora_kto.yaml differ from it in these lines.
QWEN3_LORA_DPO = QWEN3_LORA_SFT.replace("stage: sft", "stage: dpo\npref_beta: 0.1\npref_loss: sigmoid").replace(
    "dataset: identity", "dataset: dpo_en_demo").replace("learning_rate: 1.0e-4", "learning_rate: 5.0e-6").replace(
    "lora/sft", "lora/dpo")
QWEN3_LORA_KTO = QWEN3_LORA_SFT.replace("stage: sft", "stage: kto\npref_beta: 0.1").replace(
    "dataset: identity", "dataset: kto_en_demo").replace("learning_rate: 1.0e-4", "learning_rate: 5.0e-6").replace(
    "lora/sft", "lora/kto").replace("save_only_model: false\n", "")


# examples/train_lora/qwen3vl_lora_{sft,dpo}.yaml as LLaMA-Factory publishes them (their commented-out eval lines left
# out): a vision-language model's, with its image and video settings.
QWEN3VL_LORA_SFT = QWEN3_LORA_SFT.replace(
    "model_name_or_path: Qwen/Qwen3-4B-Instruct-2507\n",
    "model_name_or_path: Qwen/Qwen3-VL-4B-Instruct\nimage_max_pixels: 262144\nvideo_max_pixels: 16384\n").replace(
    "dataset: identity", "dataset: mllm_demo,identity,alpaca_en_demo  # video: mllm_video_demo").replace(
    "template: qwen3_nothink", "template: qwen3_vl_nothink").replace("qwen3-4b/", "qwen3-vl-4b/")
QWEN3VL_LORA_DPO = QWEN3VL_LORA_SFT.replace(
    "lora_target: all\n", "lora_target: all\npref_beta: 0.1\npref_loss: sigmoid  # choices: [sigmoid (dpo), orpo, simpo]\n"
).replace("stage: sft", "stage: dpo").replace("dataset: mllm_demo,identity,alpaca_en_demo  # video: mllm_video_demo",
                                              "dataset: rlhf_v").replace(
    "learning_rate: 1.0e-4", "learning_rate: 5.0e-6").replace("lora/sft", "lora/dpo")


def published(text: str, model, dataset_dir, output_dir, max_steps: int) -> str:
    """An example recipe's published text with what a run elsewhere must change: model_name_or_path, dataset_dir
    (after its dataset line), output_dir, and a step count (max_steps, after its num_train_epochs); every other line
    as published."""
    replaced = {"model_name_or_path": model, "output_dir": output_dir}
    added = {"dataset": f"dataset_dir: {dataset_dir}", "num_train_epochs": f"max_steps: {max_steps}"}
    lines = []
    for line in text.splitlines():
        key = line.split(":")[0]
        lines.append(f"{key}: {replaced[key]}" if key in replaced else line)
        if key in added:
            lines.append(added[key])
    return "\n".join(lines) + "\n"


# A flat recipe of the keys every run needs.
MINIMAL = "model_name_or_path: m\ndataset: d\noutput_dir: out\n"


def flat(tmp_path, text: str, name: str = "recipe.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text, task", [(QWEN3_LORA_SFT, "sft"), (QWEN3_LORA_DPO, "dpo"), (QWEN3_LORA_KTO, "kto")])
def test_llamafactory_examples_read_key_by_key(tmp_path, text, task):
    config = load_config(flat(tmp_path, text), [], task, 1)
    assert (config.model.name_or_path, config.model.trust_remote_code) == ("Qwen/Qwen3-4B-Instruct-2507", True)
    assert (config.peft.method, config.peft.r, config.peft.alpha, config.peft.target_modules) == \
        ("lora", 8, 16, ["all-linear"])
    data, train, checkpoint = config.data, config.train, config.checkpoint
    assert data.datasets == [{"sft": "identity", "dpo": "dpo_en_demo", "kto": "kto_en_demo"}[task]]
    assert (data.dataset_info, data.max_samples, data.num_proc, data.num_workers) == ("data", 1000, 16, 4)
    # Its template, checked against the model's own when the run starts (data/lf_templates.py).
    assert data.chat_template == "llamafactory:qwen3_nothink"
    assert (train.output_dir, train.logging_steps, train.overwrite_output_dir) == (f"saves/qwen3-4b/lora/{task}", 10,
                                                                                   True)
    assert (checkpoint.save_steps, checkpoint.save_only_model, checkpoint.resume_from_checkpoint) == (500, False, None)
    assert (config.monitor.plots, config.monitor.report_to) == (True, [])
    assert (train.per_device_train_batch_size, train.gradient_accumulation_steps, train.num_train_epochs) == (1, 8, 3.0)
    assert (train.learning_rate, train.lr_scheduler_type, train.warmup_ratio, train.bf16) == \
        ({"sft": 1e-4}.get(task, 5e-6), "cosine", 0.1, True)
    assert config.parallel.timeout_minutes == 3_000_000  # ddp_timeout's 180,000,000 s
    if task == "sft":
        assert (data.max_seq_len, data.packing) == (2048, False)  # LLaMA-Factory packs sft samples when asked
    else:  # each sequence of a pair (an example and its KL sequence) within cutoff_len; a row holds both
        section = getattr(config, task)
        assert (data.max_seq_len, section.max_length, section.beta) == (4096, 2048, 0.1)
    assert config.recipe_defaults == (["lora_alpha 16 (2 x lora_rank)", "dataset_dir data"] + (
        ["packing false (sft)"] if task == "sft" else [f"cutoff_len 2048 for each of a pair's sequences"]))


def test_lora_rank_alone_gives_llamafactorys_alpha_and_scale_and_a_sectioned_recipe_keeps_llmtunes(tmp_path):
    config = load_config(flat(tmp_path, MINIMAL + "lora_rank: 8\n"), [], "sft", 1)
    assert (config.peft.method, config.peft.r, config.peft.alpha) == ("lora", 8, 16)
    assert config.peft.alpha / config.peft.r == 2  # LoRA's scale: alpha / rank
    resolved = yaml.safe_load(yaml.safe_dump(config.to_dict()))
    assert (resolved["peft"]["r"], resolved["peft"]["alpha"]) == (8, 16)
    # What LLaMA-Factory leaves to its defaults, and llmtune's would change: said once, with the values.
    assert config.recipe_defaults == ["finetuning_type lora", "lora_alpha 16 (2 x lora_rank)",
                                      "lr_scheduler_type linear", "dataset_dir data", "packing false (sft)"]
    assert config.train.lr_scheduler_type == "linear" and config.data.packing is False
    sectioned = load_config({"model": {"name_or_path": "m"}, "data": {"train_files": ["x.jsonl"]},
                             "train": {"output_dir": "out"}, "peft": {"method": "lora", "lora_rank": 8}}, [], "sft", 1)
    assert (sectioned.peft.r, sectioned.peft.alpha, sectioned.recipe_defaults) == (8, 32.0, [])
    assert (sectioned.train.lr_scheduler_type, sectioned.data.packing) == ("cosine", True)


def test_an_override_on_the_command_line_takes_part_in_the_defaults(tmp_path):
    config = load_config(flat(tmp_path, MINIMAL), ["peft.r=32"], "sft", 1)
    assert (config.peft.r, config.peft.alpha) == (32, 64)


def test_packing_is_llamafactorys_meaning(tmp_path):
    """packing: true attends across the packed samples there; neat_packing packs them apart."""
    plain = load_config(flat(tmp_path, MINIMAL + "packing: true\n"), [], "sft", 1)
    assert (plain.data.packing, plain.data.document_mask) == (True, False)
    neat = load_config(flat(tmp_path, MINIMAL + "neat_packing: true\n"), [], "sft", 1)
    assert (neat.data.packing, neat.data.document_mask) == (True, True)


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_each_key_llmtune_has_no_such_thing_for_is_refused_with_its_reason(tmp_path, key):
    with pytest.raises(UserError) as err:
        load_config(flat(tmp_path, MINIMAL + f"{key}: 1\n"), [], "sft", 1)
    assert str(err.value) == f"{tmp_path / 'recipe.yaml'}: {key}: {REFUSED[key]}"


def test_an_unknown_key_a_stage_llmtune_lacks_and_a_mixed_recipe_are_refused(tmp_path):
    with pytest.raises(UserError, match=r"recipe.yaml: learnig_rate: no recipe key has this name; did you mean "
                                        r"--learning_rate"):
        load_config(flat(tmp_path, MINIMAL + "learnig_rate: 1e-4\n"), [], "sft", 1)
    with pytest.raises(UserError, match=r"stage 'ppo': llmtune trains pt, sft, rm, dpo, kto; ppo is not built"):
        load_config(flat(tmp_path, "model_name_or_path: m\nstage: ppo\n"), [], "sft", 1)
    with pytest.raises(UserError, match=r"stage dpo, but the command is llmtune sft; run llmtune dpo .*recipe.yaml "
                                        r"\(or llmtune train .*recipe.yaml, which reads the stage\)"):
        load_config(flat(tmp_path, "model_name_or_path: m\nstage: dpo\ndataset: d\n"), [], "sft", 1)
    with pytest.raises(UserError, match=r"recipe.yaml: learning_rate outside any section, beside sections: write every "
                                        r"key in its section"):
        load_config(flat(tmp_path, "model:\n  name_or_path: m\nlearning_rate: 1e-4\n"), [], "sft", 1)


def test_llmtune_train_takes_the_task_from_the_stage(tmp_path, capsys, monkeypatch):
    from llmtune.run import cli

    calls = []
    monkeypatch.setattr(cli, "train_command", lambda task, recipe, rest: calls.append((task, recipe, rest)) or 0)
    recipe = flat(tmp_path, QWEN3_LORA_DPO)
    assert main(["train", recipe, "--nproc", "2"]) == 0
    assert calls == [("dpo", recipe, ["--nproc", "2"])]
    sectioned = flat(tmp_path, "model:\n  name_or_path: m\n", "sectioned.yaml")
    assert main(["train", sectioned]) == 2
    assert "llmtune train reads the task from a LLaMA-Factory recipe's stage" in capsys.readouterr().err


def test_llmtune_train_help_says_what_train_does_and_given_a_recipe_its_stages_help(tmp_path, capsys):
    """`llmtune train --help` was refused as a recipe missing; given a recipe, the keys its stage's task reads."""
    assert main(["train", "--help"]) == 0
    usage, what = capsys.readouterr().out.strip().split("\n\n")
    assert usage.startswith("usage: llmtune train FLAT_RECIPE")
    assert "LLaMA-Factory recipe" in what and "the task its stage (pt, sft, rm, dpo, kto; sft where it names none)" \
        in what and "llmtune STAGE --help" in what
    recipe = flat(tmp_path, QWEN3_LORA_DPO)
    assert main(["train", recipe, "--help"]) == 0
    shown = capsys.readouterr().out
    main(["dpo", "--help"])
    assert shown.startswith(f"{usage}\n\n{what}\n\n{recipe}: stage dpo, trained as llmtune dpo trains it:\n\n")
    assert shown.endswith(capsys.readouterr().out), "then dpo's help, every key"


def test_max_samples_takes_the_first_rows_of_each_source_before_shuffling(tmp_path, tokenizer):
    from llmtune.config import DataConfig
    from llmtune.data.build import build_datasets

    rows = [f'{{"prompt": "Question {i}?", "response": "Answer {i}."}}' for i in range(10)]
    (tmp_path / "a.jsonl").write_text("\n".join(rows) + "\n")
    data = DataConfig(train_files=[str(tmp_path / "a.jsonl")], max_samples=3, packing=False,
                      cache_dir=str(tmp_path / "c"))
    train, _, _ = build_datasets("sft", data, tokenizer, 0)
    texts = sorted(tokenizer.decode(row["input_ids"]) for row in train)
    assert len(texts) == 3 and all(f"Answer {i}." in " ".join(texts) for i in range(3))


def test_llmtune_data_and_plan_take_a_flat_recipes_stage_without_task(tmp_path):
    from llmtune.config import default_task

    assert default_task(flat(tmp_path, QWEN3_LORA_KTO)) == "kto"
    assert default_task(flat(tmp_path, "model:\n  name_or_path: m\n", "sectioned.yaml")) == "sft"


def freeze_choice(tmp_path, lines: str, task: str = "sft", classifier: bool = False):
    """The parameters a flat recipe with finetuning_type freeze trains on a 4-layer Qwen3 (its names, grouped by the
    part after model.layers.N or model.), and the problems Freezing.check finds."""
    from transformers import Qwen3Config

    from llmtune.features.freezing import Freezing, chosen_names
    from llmtune.model.build import meta_model

    config = load_config(flat(tmp_path, MINIMAL + f"stage: {task}\nfinetuning_type: freeze\n" + lines), [], task, 1)
    model_config = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=False,
                               **({"num_labels": 1, "architectures": ["Qwen3ForSequenceClassification"]}
                                  if classifier else {}))
    names = [name for name, _ in meta_model(model_config, config.model).named_parameters()]
    chosen, _ = chosen_names(config.train, model_config, names)
    return config, chosen, Freezing.check(config, model_config, 1)


def test_finetuning_type_freeze_trains_the_last_two_layers_as_llamafactory_does(tmp_path):
    """LLaMA-Factory's freeze_trainable_layers 2 and freeze_trainable_modules all where the recipe leaves them out:
    every parameter of the last two decoder layers trains, nothing else; said in the banner's defaults."""
    config, chosen, problems = freeze_choice(tmp_path, "")
    assert (config.peft.method, config.train.trainable_layers, config.train.trainable_layer_modules) == \
        ("none", 2, ["all"])
    assert "freeze_trainable_layers 2" in config.recipe_defaults and problems == []
    assert chosen and {name.split(".")[2] for name in chosen} == {"2", "3"}
    assert all(name.startswith(("model.layers.2.", "model.layers.3.")) for name in chosen)
    assert len(chosen) == 2 * 11  # q, k, v, o, their q/k norms, gate, up, down, and the two layer norms


def test_freeze_choices_read_as_llamafactory_reads_them(tmp_path):
    """A negative count: the first layers; comma-separated modules of those layers; extra modules outside them,
    matched as LLaMA-Factory matches them (by substring, so an extra `norm` trains every layer's norms too)."""
    _, chosen, problems = freeze_choice(tmp_path, "freeze_trainable_layers: -1\nfreeze_trainable_modules: "
                                                  "self_attn,mlp\nfreeze_extra_modules: embed_tokens\n")
    assert problems == []
    assert chosen == {name for name in chosen if name.startswith(("model.layers.0.self_attn.", "model.layers.0.mlp.",
                                                                  "model.embed_tokens."))}
    assert {name.split(".")[3] for name in chosen if ".layers." in name} == {"self_attn", "mlp"}
    assert "model.embed_tokens.weight" in chosen
    _, norms, _ = freeze_choice(tmp_path, "freeze_trainable_layers: 1\nfreeze_trainable_modules: mlp\n"
                                          "freeze_extra_modules: norm\n")
    assert "model.norm.weight" in norms and "model.layers.0.input_layernorm.weight" in norms
    assert "model.layers.3.mlp.up_proj.weight" in norms and "model.layers.2.mlp.up_proj.weight" not in norms


def test_freeze_modules_the_model_lacks_are_named_with_the_choices(tmp_path):
    _, _, problems = freeze_choice(tmp_path, "freeze_trainable_modules: attn\nfreeze_extra_modules: head\n")
    assert problems == [
        "train.trainable_layer_modules (freeze_trainable_modules): 'attn' is no module of the decoder layers; choose "
        "from all, input_layernorm, mlp, post_attention_layernorm, self_attn",
        "train.trainable_extra_modules (freeze_extra_modules): 'head' is no module outside the decoder layers; choose "
        "from embed_tokens, lm_head, norm"]
    _, chosen, problems = freeze_choice(tmp_path, "freeze_trainable_layers: 0\n")
    assert chosen == set() and problems == ["train: every parameter is frozen (trainable_modules, frozen_modules, "
                                            "trainable_layers); nothing is left to train"]


def test_a_reward_models_new_score_head_trains_under_freeze(tmp_path):
    """As LLaMA-Factory's value head does: a new head is never left at its random start."""
    _, chosen, problems = freeze_choice(tmp_path, "freeze_trainable_layers: 1\n", "rm", classifier=True)
    assert problems == [] and "score.weight" in chosen
    assert {name for name in chosen if not name.startswith("model.layers.3.")} == {"score.weight"}


def test_freeze_settings_without_freeze_are_refused(tmp_path):
    """LLaMA-Factory reads freeze_* with finetuning_type freeze alone; here they are never silently dropped."""
    with pytest.raises(UserError) as err:
        load_config(flat(tmp_path, MINIMAL + "finetuning_type: full\nfreeze_extra_modules: norm\n"), [], "sft", 1)
    assert str(err.value).endswith("train.trainable_extra_modules: read with train.trainable_layers (finetuning_type "
                                   "freeze); set that too, or leave trainable_extra_modules out")
    from llmtune.features.adapters import Adapters

    lora = load_config(flat(tmp_path, MINIMAL + "freeze_trainable_layers: 2\n"), [], "sft", 1)
    assert Adapters.check(lora, None, 1)[0].startswith("train.trainable_modules / frozen_modules / trainable_layers "
                                                       "(finetuning_type freeze): not used with peft")


@pytest.mark.parametrize("text, task", [(QWEN3VL_LORA_SFT, "sft"), (QWEN3VL_LORA_DPO, "dpo")])
def test_llamafactorys_vision_language_examples_read_key_by_key(tmp_path, text, task):
    """Its image bounds are data.image_max_pixels (image_min_pixels keeps LLaMA-Factory's default); its video
    settings are read and change nothing (llmtune reads no videos); the parts of the model that train are
    LLaMA-Factory's defaults: the vision tower and the projector frozen, the language model trained."""
    config = load_config(flat(tmp_path, text), [], task, 1)
    assert config.model.name_or_path == "Qwen/Qwen3-VL-4B-Instruct"
    assert (config.data.image_max_pixels, config.data.image_min_pixels) == (262144, 32 * 32)
    assert config.data.datasets == (["mllm_demo", "identity", "alpaca_en_demo"] if task == "sft" else ["rlhf_v"])
    assert config.data.chat_template == "llamafactory:qwen3_vl_nothink"
    assert (config.train.freeze_vision_tower, config.train.freeze_multi_modal_projector,
            config.train.freeze_language_model) == (True, True, False)
    assert (config.peft.method, config.peft.target_modules) == ("lora", ["all-linear"])


def test_the_vision_language_parts_that_train_are_read_from_a_flat_recipe(tmp_path):
    text = MINIMAL + "freeze_vision_tower: false\nfreeze_multi_modal_projector: false\nfreeze_language_model: true\n"
    config = load_config(flat(tmp_path, text), [], "sft", 1)
    assert (config.train.freeze_vision_tower, config.train.freeze_multi_modal_projector,
            config.train.freeze_language_model) == (False, False, True)


def test_llamafactorys_fp8_keys_are_train_fp8_tensorwise_on_torchao(tmp_path):
    """fp8: true with its torchao backend and its float8 all-gather is train.fp8 tensorwise (which always gathers in
    float8); Transformer Engine's backend is refused."""
    keys = "bf16: true\ntorch_compile: true\nfp8: true\nfp8_backend: torchao\nfp8_enable_fsdp_float8_all_gather: true\n"
    config = load_config(flat(tmp_path, MINIMAL + keys), [], "sft", 1)
    assert config.train.float8_scaling() == "tensorwise"
    with pytest.raises(UserError, match="fp8_backend 'te': llmtune's float8 training .fp8. is torchao's; leave "
                                        "fp8_backend out, or set it to auto or torchao"):
        load_config(flat(tmp_path, MINIMAL + keys.replace("torchao", "te")), [], "sft", 1)
