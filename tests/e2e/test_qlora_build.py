"""QLoRA (peft.method: qlora = lora on a base of model.quantize: nf4) built as a run builds it, on one process:
- its step-0 loss equals that of the same model built plainly (transformers, torchao's to_nf4 on every linear weight
  of the decoder layers, peft's LoRA with the run's initial adapters), to 1e-5 relative, and is finite;
- under bf16 the base's linear weights are NF4 tensors of about a quarter of their bf16 bytes (measured: their
  packed values and scales), the adapters fp32 master weights (FSDP2 computes them in bf16), and AdamW holds the
  adapters alone;
- a dpo run's reference copy (dpo.reference: model) is quantized as the policy's base: at step 0, where the policy
  is its reference, the rewards are exactly 0 and the loss ln 2;
- the demo's model, whose k_proj and v_proj are half a group of NF4, trains on one process, those two in the compute
  dtype and the rest in nf4, as the start banner says.
The 2-process runs (layout, resume, export, memory per rank when sharded) are tests/dist/test_qlora.py's."""

import logging
import math

import pytest
import torch
import torch.nn.functional as F
import yaml
from peft import LoraConfig, inject_adapter_in_model
from torch import nn
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, to_nf4
from transformers import AutoModelForCausalLM

import llmtune
from llmtune.config import load_config
from llmtune.model.quantize import held, is_quantized, stored_bytes
from llmtune.model.state import whole
from llmtune.run.parallel import ParallelState
from llmtune.run.worker import build_trainer
from tests.helpers import read_metrics

pytestmark = pytest.mark.slow  # each test builds a run (~3 s)

PROBE = "The sum of 12 and 30 is 42. 7 + 8 = 15."
LORA = {"method": "qlora", "r": 4, "alpha": 8, "init_lora_weights": False}


@pytest.fixture
def recipe(nf4_llama, sft_file, tmp_path) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(nf4_llama)},
        "data": {"train_files": [str(sft_file)], "max_seq_len": 64, "chat_template": "basic"},
        "train": {"output_dir": str(tmp_path / "out"), "max_steps": 1, "per_device_train_batch_size": 2},
        "peft": LORA,
    }))
    return str(path)


def built(recipe: str, *overrides: str):
    """(trainer, state) of a one-process run (close the state after)."""
    state = ParallelState.initialize()
    return build_trainer(load_config(recipe, list(overrides), "sft", 1), state)[0], state


def plain_qlora(folder, adapters: dict[str, torch.Tensor]) -> nn.Module:
    """The model quantized without llmtune: transformers' model, peft's LoRA (its adapters set to `adapters`), every
    linear weight of the decoder layers but the adapters' replaced by torchao's NF4 of it (QLoRA's block sizes)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    inject_adapter_in_model(LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], target_modules="all-linear"), model)
    model.load_state_dict(adapters, strict=False)
    for name, module in model.named_modules():
        if type(module) is nn.Linear and ".layers." in name and ".lora_" not in name:
            module.weight = nn.Parameter(to_nf4(module.weight.detach(), 64, 256), requires_grad=False)
    return model


def test_step_0_loss_equals_the_plainly_quantized_models(recipe, nf4_llama, bare_tokenizer):
    ids = torch.tensor([bare_tokenizer(PROBE)["input_ids"]])
    shift_labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    trainer, state = built(recipe)
    try:
        hf_model = trainer.model.hf_model
        adapters = {name: whole(param).clone() for name, param in hf_model.named_parameters() if param.requires_grad}
        assert adapters and all(".lora_" in name for name in adapters)
        with torch.no_grad():
            loss = trainer.model(input_ids=ids, shift_labels=shift_labels)
    finally:
        state.close()
    with torch.no_grad():
        logits = plain_qlora(nf4_llama, adapters)(ids).logits
    expected = F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    with torch.no_grad():
        unquantized = AutoModelForCausalLM.from_pretrained(nf4_llama, dtype=torch.float32)
        inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"), unquantized)
        unquantized.load_state_dict(adapters, strict=False)
        other = F.cross_entropy(unquantized(ids).logits[0, :-1], ids[0, 1:], reduction="sum")
    assert not torch.isclose(loss, other, rtol=1e-4, atol=0), "the base computes in 4 bits, not in fp32"


def test_under_bf16_the_base_is_nf4_at_a_quarter_of_its_bf16_bytes_and_adamw_holds_the_adapters(recipe):
    trainer, state = built(recipe, "train.bf16=true")
    try:
        named = dict(trainer.model.hf_model.named_parameters())
        quantized = {name: param for name, param in named.items() if is_quantized(param)}
        optimized = {id(param) for group in trainer.optimizer.param_groups for param in group["params"]}
    finally:
        state.close()
    assert len(quantized) == 2 * 7, "the 7 linear layers of 2 decoder layers"
    assert all(name.endswith(".base_layer.weight") for name in quantized)
    assert all(isinstance(held(param), NF4Tensor) and param.dtype == torch.bfloat16 for param in quantized.values())
    ratio = sum(stored_bytes(held(p)) for p in quantized.values()) / sum(2 * p.numel() for p in quantized.values())
    assert 0.25 < ratio < 0.32
    others = {name: param for name, param in named.items() if name not in quantized}
    assert {param.dtype for name, param in others.items() if ".lora_" in name} == {torch.float32}
    assert {param.dtype for name, param in others.items() if ".lora_" not in name} == {torch.bfloat16}
    assert optimized == {id(param) for name, param in named.items() if ".lora_" in name}


def test_a_dpo_reference_copy_is_quantized_as_the_policys_base(nf4_llama, assets, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    rows = (assets / "data" / "dpo_train.jsonl").read_text().splitlines()[:8]
    pairs.write_text("".join(row + "\n" for row in rows))
    llmtune.train("dpo", {
        "model": {"name_or_path": nf4_llama},
        "data": {"train_files": [pairs], "chat_template": "basic", "max_seq_len": 128},
        "train": {"output_dir": tmp_path / "out", "max_steps": 1, "per_device_train_batch_size": 2},
        "peft": {"method": "qlora", "r": 4}, "dpo": {"reference": "model"},
        "checkpoint": {"export_hf": False}, "monitor": {"plots": False}})
    first = read_metrics(tmp_path / "out")[0]
    assert first["rewards/chosen"] == first["rewards/rejected"] == 0.0
    assert first["loss"] == pytest.approx(math.log(2), rel=1e-6)


def test_the_demos_model_trains_on_one_process_with_the_weights_nf4_cannot_hold_unquantized(assets, tmp_path,
                                                                                             caplog):
    caplog.set_level(logging.INFO, logger="llmtune")
    result = llmtune.train("pt", {
        "model": {"config": assets / "model", "tokenizer": assets / "tokenizer"},
        "data": {"train_files": [assets / "data" / "pt.jsonl"], "max_seq_len": 64},
        "train": {"output_dir": tmp_path / "out", "max_steps": 1, "per_device_train_batch_size": 2},
        "peft": {"method": "qlora", "r": 4}, "checkpoint": {"export_hf": False}, "monitor": {"plots": False}})
    assert result.steps == 1 and math.isfinite(result.loss)
    # 2 layers: q_proj and o_proj of 128 x 128, gate_proj, up_proj and down_proj of 512 x 128 in nf4; k_proj and
    # v_proj of 64 x 128 (half of NF4's group of 16,384 values) not.
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("start: parameters "))
    assert f"; {2 * (2 * 128 * 128 + 3 * 512 * 128):,} frozen in nf4 (model.quantize), {2 * 2 * 64 * 128:,} frozen " \
           "in the compute dtype" in line
