"""QLoRA's pieces, without a run: a rank's NF4 rows are those of the whole weight quantized (a shard quantized alone
is not); peft.method: qlora reads as lora with model.quantize: nf4; what cannot run on a 4-bit base is refused before
anything is built, each with its reason and fix; `llmtune plan` counts the base at NF4's bytes, names the
quantization, and offers QLoRA after LoRA; the start banner counts the parameters held in nf4."""

import importlib.util

import pytest
import torch
import yaml
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
from transformers import AutoConfig

from llmtune.config import ModelConfig, load_config
from llmtune.errors import UserError
from llmtune.features import quantization
from llmtune.features.quantization import QuantizedBase
from llmtune.model.build import base_fingerprint
from llmtune.model.quantize import GROUP, dequantized, nf4_bytes, set_rows
from llmtune.run.banner import Banner
from llmtune.run.plan import changes, plan_memory, render


def test_a_ranks_rows_are_those_of_the_whole_weight_quantized():
    torch.manual_seed(0)
    weight = torch.randn(64, 1024) * 0.02  # 4 groups of 16384 values: 2 per rank on 2 ranks
    whole = dequantized(to_nf4(weight, 64, 256))
    for start in (0, 32):
        shard = to_nf4(torch.zeros(32, 1024), 64, 256)  # a shard's NF4 tensor, as FSDP2 holds it, before the load
        set_rows(shard, weight, start)
        assert torch.equal(dequantized(shard), whole[start:start + 32])
    alone = dequantized(to_nf4(weight[32:], 64, 256))
    assert not torch.equal(alone, whole[32:]), "the rows quantized alone (against their own mean scale) differ"


def write(tmp_path, folder, **sections) -> str:
    recipe = {"model": {"name_or_path": str(folder)}, "data": {"train_files": ["train.jsonl"]},
              "train": {"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 2},
              "peft": {"method": "qlora"}}
    for section, values in sections.items():
        recipe[section] = {**recipe.get(section, {}), **values}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def test_qlora_reads_as_lora_on_an_nf4_base(tmp_path, nf4_llama):
    config = load_config(write(tmp_path, nf4_llama), [], "sft", 1)
    assert (config.peft.method, config.model.quantize) == ("lora", "nf4")
    assert config.to_dict()["peft"]["method"] == "lora" and config.to_dict()["model"]["quantize"] == "nf4"
    assert load_config(write(tmp_path, nf4_llama, peft={"method": "lora"}, model={"quantize": "nf4"}), [], "sft",
                       1).model.quantize == "nf4"


@pytest.mark.parametrize("sections, message", [
    ({"model": {"quantize": "none"}}, "peft.method qlora is lora with model.quantize nf4, but model.quantize is none"),
    ({"model": {"quantize": "nf8"}, "peft": {"method": "lora"}},
     "model.quantize: 'nf8' is not valid; did you mean 'nf4'?"),
    ({"model": {"quantize": "nf4"}, "peft": {"method": "none"}},
     "model.quantize: nf4 holds the frozen base in 4 bits, and this run trains every weight"),
    ({"model": {"quantize": "nf4"}, "peft": {"method": "dora"}},
     "peft.method: dora cannot run on a base of model.quantize nf4: peft's DoRA reads a torchao weight through its "
     "dequantize(), which torchao's NF4Tensor does not have; set peft.method: lora"),
])
def test_recipes_that_cannot_train_on_a_4_bit_base_are_refused(tmp_path, nf4_llama, sections, message):
    with pytest.raises(UserError) as error:
        load_config(write(tmp_path, nf4_llama, **sections), [], "sft", 1)
    assert message in str(error.value)


def check(tmp_path, folder, world_size: int, *overrides: str) -> list[str]:
    config = load_config(write(tmp_path, folder), list(overrides), "sft", world_size)
    return QuantizedBase.check(config, AutoConfig.from_pretrained(folder), world_size)


def test_weights_that_do_not_split_into_whole_groups_per_rank_are_refused_by_name(tmp_path, nf4_llama):
    assert check(tmp_path, nf4_llama, 1) == [] and check(tmp_path, nf4_llama, 2) == []
    (problem,) = check(tmp_path, nf4_llama, 4)
    assert problem.startswith("model.quantize: nf4 cannot hold model.layers.0.self_attn.k_proj.weight (shape "
                              "[128, 256]) and 3 more weights sharded over 4 rank(s): each rank's equal share")
    assert f"whole groups of {GROUP} values" in problem
    assert problem.endswith("; shard each copy of the model over 1 or 2 rank(s) (the world size / "
                            "parallel.dp_replicate), or set model.quantize: none (LoRA on the unquantized base)")


def test_on_one_rank_only_weights_of_no_whole_group_stay_unquantized(tmp_path, assets, tiny_model):
    """The demo's k_proj and v_proj (64 x 128: half a group) torchao cannot quantize at QLoRA's block sizes on any
    number of ranks: they stay in the compute dtype, and the rest is quantized; one rank no longer asks for another
    number of ranks. A model none of whose weights is a whole number of groups is refused, with what trains it."""
    demo = AutoConfig.from_pretrained(assets / "model")
    config = load_config(write(tmp_path, assets / "model"), [], "sft", 1)
    frozen = quantization.planned_linears(config, demo)
    held = {name.rpartition(".")[2] for name, linear in frozen.items() if linear.weight.numel() % GROUP == 0}
    assert held == {"q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert QuantizedBase.check(config, demo, 1) == []
    (problem,) = check(tmp_path, tiny_model, 1)
    assert problem == (f"model.quantize: nf4 holds a weight in whole groups of {GROUP} values (NF4 scales blocks of 64 "
                       "values and quantizes those scales in groups of 256), and no linear weight of llama's decoder "
                       "layers has a multiple of 16384 values (the largest, model.layers.0.mlp.gate_proj.weight, "
                       "[64, 32], has 2048); set model.quantize: none (LoRA on the unquantized base)")


def test_a_model_without_linear_layers_to_quantize_is_refused(tmp_path, bare_tokenizer):
    from transformers import GPT2LMHeadModel

    from tests.helpers import save_tiny_model

    gpt2 = save_tiny_model(tmp_path / "gpt2", GPT2LMHeadModel, bare_tokenizer, n_embd=256, n_layer=1, n_head=4)
    assert check(tmp_path, gpt2, 1) == ["model.quantize: nf4 quantizes the linear layers (torch.nn.Linear) of the "
                                        "decoder layers, and gpt2's have none (GPT-2's, for one, are Conv1D); "
                                        "set model.quantize: none (LoRA on the unquantized base)"]


def test_modules_trained_in_full_are_not_quantized_nor_checked(tmp_path, nf4_llama):
    config = load_config(write(tmp_path, nf4_llama, peft={"modules_to_save": ["k_proj"]}), [], "sft", 4)
    planned = quantization.planned_linears(config, AutoConfig.from_pretrained(nf4_llama))
    assert len(planned) == 2 * 6 and not any(name.endswith("k_proj") for name in planned)
    assert "self_attn.v_proj.weight (shape [128, 256]) and 1 more weights sharded over 4" in \
        QuantizedBase.check(config, AutoConfig.from_pretrained(nf4_llama), 4)[0]


def test_a_missing_torchao_is_refused_with_the_extra_to_install(tmp_path, nf4_llama, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "torchao" else
                        find_spec(name, *args))
    assert check(tmp_path, nf4_llama, 1) == ['model.quantize: nf4 needs torchao, which is not installed; pip install '
                                             '-e ".[qlora]" (or pip install torchao), or set model.quantize: none '
                                             '(LoRA on the unquantized base)']


def test_cpu_offload_on_one_gpu_is_refused(tmp_path, nf4_llama, monkeypatch):
    """On one rank the NF4 weights stay outside FSDP2, so outside its offload: in the CPU's memory, where a GPU
    cannot compute with them (on a CPU-only machine the run trains; tests/e2e covers offload on two ranks' path)."""
    assert check(tmp_path, nf4_llama, 1, "parallel.cpu_offload=true") == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    (problem,) = check(tmp_path, nf4_llama, 1, "parallel.cpu_offload=true")
    assert problem.startswith("parallel.cpu_offload: sharded over one rank, the 4-bit base of model.quantize stays outside")
    assert check(tmp_path, nf4_llama, 2, "parallel.cpu_offload=true") == []


def test_the_plan_counts_the_base_in_nf4_and_names_it(tmp_path, nf4_llama):
    model_config = AutoConfig.from_pretrained(nf4_llama)
    lora = plan_memory(load_config(write(tmp_path, nf4_llama, peft={"method": "lora"}), [], "sft", 2),
                       model_config, 2)
    config = load_config(write(tmp_path, nf4_llama), [], "sft", 2)
    qlora = plan_memory(config, model_config, 2)
    linears = 2 * (2 * 256 * 256 + 2 * 128 * 256 + 3 * 512 * 256)
    assert qlora.quantized == linears
    assert lora.params - qlora.params == linears // 2 * 4 - nf4_bytes(linears // 2, torch.float32)
    assert qlora.dequantized > 0 and qlora.peak - qlora.dequantized < lora.peak
    assert "quantization: nf4 (model.quantize)" in render(qlora, config, model_config, None, None).splitlines()[1]


def test_the_fit_advice_offers_qlora_after_lora_where_the_shapes_split(tmp_path, nf4_llama):
    model_config = AutoConfig.from_pretrained(nf4_llama)
    full = load_config(write(tmp_path, nf4_llama, peft={"method": "none"}), [], "sft", 2)
    offered = [change for change, _, _ in changes(full, 2, model_config)]
    assert offered[-2].startswith("peft.method: lora") and offered[-1].startswith("peft.method: qlora")
    *_, (_, changed, ranks) = changes(full, 2, model_config)
    assert (changed.peft.method, changed.model.quantize, ranks) == ("lora", "nf4", 2)
    four = load_config(write(tmp_path, nf4_llama, peft={"method": "none"}), [], "sft", 4)
    assert not any(change.startswith("peft.method: qlora") for change, _, _ in changes(four, 4, model_config))


def test_the_banner_counts_the_parameters_held_in_nf4():
    banner = Banner(rows=8, unit="samples", steps_per_epoch=2, total_steps=2, first_step=0, global_batch=4,
                    micro_batch=4, accumulation=1, dp=1, layout="1 rank(s)", params=1000, trainable=10, decay=(2, 10),
                    no_decay=(0, 0), precision="fp32", attention="sdpa", checkpointing="none", peak="1 MiB",
                    quantized=900)
    assert banner.lines()[3].endswith("; 900 frozen in nf4 (model.quantize)")
    assert "nf4" not in " ".join(Banner(**{**banner.__dict__, "quantized": 0}).lines())


def test_the_base_fingerprint_tells_a_quantized_base_apart(nf4_llama):
    """A checkpoint of adapters trained on the 4-bit base resumes only on it, and a reference's precomputed
    log-probabilities are those of the base the run computes with."""
    model_config = AutoConfig.from_pretrained(nf4_llama)
    plain, quantized = (base_fingerprint(ModelConfig(name_or_path=str(nf4_llama), quantize=quantize), model_config, 0)
                        for quantize in ("none", "nf4"))
    assert plain != quantized
    from_config = [base_fingerprint(ModelConfig(config="c.json", quantize=quantize), model_config, 0)
                   for quantize in ("none", "nf4")]
    assert from_config[0] != from_config[1]
