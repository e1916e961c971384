"""A flat LLaMA-Factory recipe trains as it is written: `llmtune train FILE` takes the task from its stage, the keys
are read into their sections, and LLaMA-Factory's defaults for what it leaves out are the run's (the resolved
config.yaml and the exported adapter say so, the start banner names them). The unit tests read the keys one by one
(tests/unit/test_llamafactory_recipes.py)."""

import json

import pytest
import torch
import yaml

from llmtune.run.cli import main


def test_a_flat_recipe_trains_with_llamafactorys_defaults(tiny_model, tmp_path, capsys):
    rows = [{"instruction": f"Add {a} and {a + 1}.", "input": "", "output": f"{2 * a + 1}"} for a in range(12)]
    (tmp_path / "sums.json").write_text(json.dumps(rows))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"sums": {"file_name": "sums.json"}}))
    recipe = tmp_path / "lora_sft.yaml"
    recipe.write_text(f"""\
model_name_or_path: {tiny_model}
stage: sft
do_train: true
lora_rank: 4
dataset: sums
dataset_dir: {tmp_path}
chat_template: basic
cutoff_len: 128
max_samples: 8
output_dir: {tmp_path / "out"}
per_device_train_batch_size: 2
gradient_accumulation_steps: 2
max_steps: 2
learning_rate: 1.0e-4
report_to: none
plot_loss: false
""")
    assert main(["train", str(recipe)]) == 0
    out = tmp_path / "out"
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert (resolved["peft"]["method"], resolved["peft"]["r"], resolved["peft"]["alpha"]) == ("lora", 4, 8)
    assert (resolved["train"]["lr_scheduler_type"], resolved["data"]["packing"], resolved["data"]["max_samples"]) == \
        ("linear", False, 8)
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (4, 8)
    log = (out / "train.log").read_text()
    assert "start: LLaMA-Factory recipe: its defaults for finetuning_type lora, lora_alpha 8 (2 x lora_rank), " \
           "lr_scheduler_type linear, packing false (sft)" in log
    # 8 samples (max_samples), each its own row (no packing): 2 optimizer steps of 4.
    assert "data: 8 samples" in log


def test_a_dpo_recipe_trains_as_many_pairs_a_step_as_it_says(tiny_model, pairs_file, tmp_path):
    """per_device_train_batch_size 1 x gradient_accumulation_steps 8: 8 pairs a step, as LLaMA-Factory and TRL count
    them, however the collator packs each micro-batch's pairs into rows (the epoch advances by 8 of the 48 pairs a
    step)."""
    from tests.helpers import read_metrics

    recipe = tmp_path / "lora_dpo.yaml"
    recipe.write_text(f"""\
model_name_or_path: {tiny_model}
stage: dpo
lora_rank: 4
pref_beta: 0.1
pref_loss: sigmoid
chat_template: basic
cutoff_len: 64
output_dir: {tmp_path / "out"}
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
max_steps: 2
logging_steps: 1
report_to: none
plot_loss: false
""".replace("chat_template: basic", f"chat_template: basic\ntrain_files: [{pairs_file}]"))
    assert main(["train", str(recipe)]) == 0
    assert [r["epoch"] for r in read_metrics(tmp_path / "out") if "loss" in r] == [8 / 48, 16 / 48]
    assert "start: global batch 8 pairs = micro-batch 1 x accumulation 8 x 1 data-parallel" in \
        (tmp_path / "out" / "train.log").read_text()


def test_a_freeze_recipe_trains_the_last_layers_alone(tiny_model, sft_file, tmp_path):
    """finetuning_type freeze, freeze_trainable_layers 1: the exported model differs from the start in the last
    decoder layer's weights alone, every one of them moved."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    recipe = tmp_path / "freeze_sft.yaml"
    recipe.write_text(f"""\
model_name_or_path: {tiny_model}
stage: sft
finetuning_type: freeze
freeze_trainable_layers: 1
train_files: [{sft_file}]
chat_template: basic
cutoff_len: 64
output_dir: {tmp_path / "out"}
per_device_train_batch_size: 2
max_steps: 1
learning_rate: 1.0e-3
export_dtype: fp32
report_to: none
plot_loss: false
""")
    assert main(["train", str(recipe)]) == 0
    last = f"model.layers.{AutoConfig.from_pretrained(tiny_model).num_hidden_layers - 1}."
    start, end = load_file(tiny_model / "model.safetensors"), load_file(tmp_path / "out" / "hf" / "model.safetensors")
    moved = {name for name in start if not torch.equal(start[name], end[name])}
    assert moved == {name for name in start if name.startswith(last)} and moved


# LLaMA-Factory's demo datasets' entries in its data/dataset_info.json and a few rows in their forms.
DEMO_DATA = {
    "identity": ({"file_name": "identity.json"},
                 [{"instruction": f"What is {a} plus {a + 1}?", "input": "", "output": f"It is {2 * a + 1}."}
                  for a in range(12)]),
    "dpo_en_demo": ({"file_name": "dpo_en_demo.json", "ranking": True, "formatting": "sharegpt",
                     "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}},
                    [{"conversations": [{"from": "human", "value": f"What is {a} plus {a + 1}?"}],
                      "chosen": {"from": "gpt", "value": f"It is {2 * a + 1}."},
                      "rejected": {"from": "gpt", "value": f"It is {2 * a}."}} for a in range(12)]),
    "kto_en_demo": ({"file_name": "kto_en_demo.json", "formatting": "sharegpt",
                     "columns": {"messages": "messages", "kto_tag": "label"},
                     "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                              "assistant_tag": "assistant"}},
                    [{"messages": [{"role": "user", "content": f"What is {a} plus {a + 1}?"},
                                   {"role": "assistant", "content": f"It is {2 * a + 1 + a % 2}."}],
                      "label": a % 2 == 0} for a in range(12)]),
}


def write_example(example: str, dataset: str, folder, model):
    """LLaMA-Factory's example recipe `example` (tests/unit/test_llamafactory_recipes.py's copy of its published
    text) written in folder with its demo dataset, but for model_name_or_path (`model`), dataset_dir, output_dir
    (folder/out) and a step count (max_steps 1)."""
    from tests.unit import test_llamafactory_recipes as examples

    entry, rows = DEMO_DATA[dataset]
    (folder / entry["file_name"]).write_text(json.dumps(rows))
    (folder / "dataset_info.json").write_text(json.dumps({dataset: entry}))
    recipe = folder / "recipe.yaml"
    recipe.write_text(examples.published(getattr(examples, example), model, folder, folder / "out", 1))
    return recipe


@pytest.fixture(scope="module")
def qwen_with_chatml(tmp_path_factory):
    """A tiny Qwen2 whose tokenizer's chat template is plain ChatML, which renders as LLaMA-Factory's qwen3_nothink."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.helpers import byte_level_tokenizer
    from tests.unit.test_lf_templates import PLAIN_CHATML

    model = tmp_path_factory.mktemp("qwen_chatml")
    tokenizer = byte_level_tokenizer(model, PLAIN_CHATML)
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
                     ).save_pretrained(model)
    return model


@pytest.mark.parametrize("example, dataset, unit", [("QWEN3_LORA_SFT", "identity", "samples"),
                                                    ("QWEN3_LORA_DPO", "dpo_en_demo", "pairs"),
                                                    ("QWEN3_LORA_KTO", "kto_en_demo", "examples")])
def test_llamafactorys_qwen3_lora_examples_run_as_published(qwen_with_chatml, tmp_path, capsys, example, dataset,
                                                            unit):
    """examples/train_lora/qwen3_lora_{sft,dpo,kto}.yaml as published but for model_name_or_path, dataset_dir,
    output_dir and a step count: the template is checked and the model's own trained with, bf16 on this CPU, 8
    examples a step (1 x accumulation 8), the rest read as the unit tests say."""
    recipe = write_example(example, dataset, tmp_path, qwen_with_chatml)
    assert main(["train", str(recipe)]) == 0
    log = (tmp_path / "out" / "train.log").read_text()
    assert "the model's own chat template renders conversations as LLaMA-Factory's qwen3_nothink does" in \
        capsys.readouterr().err + log
    assert f"start: global batch 8 {unit} = micro-batch 1 x accumulation 8 x 1 data-parallel" in log
