"""QLoRA on FSDP2 (peft.method: qlora: LoRA on a base whose linear weights are NF4, model.quantize), fp32, sft on
packed rows of 96 tokens, a global batch of 4 rows; one 2-process launch (a run, then its resume from step 2)
against a one-process run in this process:
- each rank holds half of every quantized weight, as NF4 (a DTensor of an NF4Tensor, its packed values and scales
  measured): about a quarter of the bytes of the same rows in bf16;
- losses finite, falling, and the same on 1 and 2 processes (1e-5 relative; the adapters to 1e-5 absolute): the
  values a rank holds are its rows of the whole weight quantized, whatever the number of ranks;
- the checkpoint holds the adapters alone, and the run resumes from it bitwise (losses and adapters);
- the merged folder (the adapters merged into the dequantized base, fp32) loaded by transformers, and the adapter
  folder loaded by peft onto the base dequantized, give the trained model's logits (1e-5 absolute: the same sums in
  another order, in fp32); `llmtune export --merge` of the checkpoint writes the same merged folder.
"""

import json
from pathlib import Path

import pytest
import torch
import yaml
from peft import PeftModel
from safetensors.torch import load_file
from torch import nn
from torch.distributed.tensor import DTensor
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, to_nf4
from transformers import AutoModelForCausalLM

from llmtune.checkpoint.validate import saved_model_shapes
from llmtune.model.quantize import held, is_quantized, stored_bytes
from llmtune.run.cli import main as cli_main
from llmtune.training.callbacks import Callback
from tests.dist.case_worker import run_case
from tests.helpers import launch_cases, read_metrics

PROBE = "The sum of 12 and 30 is 42. 7 + 8 = 15."


class BaseBytes(Callback):
    """Each rank's quantized weights as training begins, in output_dir/base_bytes_<rank>.json: per weight, its
    rows here, whether it is sharded, whether its local tensor is NF4, and the bytes of its packed values and scales
    beside those of the same values in bf16."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        weights = {name: param for name, param in model.named_parameters() if is_quantized(param)}
        found = {name: {"rows": len(held(param)), "sharded": isinstance(param, DTensor),
                        "nf4": isinstance(held(param), NF4Tensor), "bytes": stored_bytes(held(param)),
                        "bf16_bytes": 2 * held(param).numel()} for name, param in weights.items()}
        (Path(args.train.output_dir) / f"base_bytes_{state.rank}.json").write_text(json.dumps(found))


def write_recipe(path, model, data) -> str:
    path.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(model)},
        "data": {"train_files": [str(data)], "max_seq_len": 96, "chat_template": "basic"},
        "train": {"max_steps": 4, "per_device_train_batch_size": 2, "global_batch_size": 4, "logging_steps": 1,
                  "learning_rate": 5e-3, "chunk_loss_size": 32, "callbacks": ["tests.dist.test_qlora:BaseBytes"]},
        "peft": {"method": "qlora", "r": 4, "alpha": 8, "init_lora_weights": False},
        "checkpoint": {"export_dtype": "fp32", "export_merged": True, "save_steps": 2},
        "monitor": {"console": False},
    }))
    return str(path)


@pytest.fixture(scope="module")
def runs(nf4_llama, bare_tokenizer, sft_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("qlora")
    recipe = write_recipe(root / "qlora.yaml", nf4_llama, sft_file)
    out = {name: root / name for name in ("qlora", "resumed", "one_process")}
    step_2 = out["qlora"] / "checkpoints" / "global_step_2"
    cases = [{"recipe": recipe, "overrides": [f"train.output_dir={out['qlora']}"],
              "probe": bare_tokenizer(PROBE)["input_ids"]},
             {"recipe": recipe, "overrides": [f"train.output_dir={out['resumed']}",
                                              f"checkpoint.resume_from_checkpoint={step_2}"]}]
    launch_cases(cases, root)
    run_case(recipe, [f"train.output_dir={out['one_process']}", "checkpoint.save_steps=0",
                      "checkpoint.export_merged=false"], 1)
    return out


def losses(output_dir) -> list[float]:
    return [record["loss"] for record in read_metrics(output_dir)]


def adapter(output_dir) -> dict[str, torch.Tensor]:
    return load_file(output_dir / "adapter" / "adapter_model.safetensors")


def probe_logits(model, tokenizer) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokenizer(PROBE)["input_ids"]])).logits


def test_each_rank_holds_half_of_every_weight_in_nf4_at_a_quarter_of_bf16(runs):
    ranks = [json.loads((runs["qlora"] / f"base_bytes_{rank}.json").read_text()) for rank in (0, 1)]
    whole = json.loads((runs["one_process"] / "base_bytes_0.json").read_text())
    assert len(whole) == 2 * 7 and all(ranks[rank].keys() == whole.keys() for rank in (0, 1))
    for rank in ranks:
        assert all(weight["sharded"] and weight["nf4"] for weight in rank.values())
        assert all(weight["rows"] * 2 == whole[name]["rows"] for name, weight in rank.items())
        ratio = sum(weight["bytes"] for weight in rank.values()) / sum(weight["bf16_bytes"] for weight in rank.values())
        assert 0.25 < ratio < 0.32


def test_losses_are_finite_and_the_same_on_one_and_two_processes(runs):
    two = losses(runs["qlora"])
    assert len(two) == 4 and all(torch.isfinite(torch.tensor(two)))
    assert two[-1] < two[0], "it learns"
    assert losses(runs["one_process"]) == pytest.approx(two, rel=1e-5)
    one, two = adapter(runs["one_process"]), adapter(runs["qlora"])
    assert one.keys() == two.keys()
    for name in two:
        torch.testing.assert_close(one[name], two[name], rtol=0, atol=1e-5, msg=name)


def test_the_checkpoint_holds_the_adapters_and_resumes_bitwise(runs):
    saved = saved_model_shapes(runs["qlora"] / "checkpoints" / "global_step_2")
    assert len(saved) == 2 * 7 * 2 and all(".lora_A." in name or ".lora_B." in name for name in saved)
    assert [record["step"] for record in read_metrics(runs["resumed"])] == [3, 4]
    assert losses(runs["resumed"]) == losses(runs["qlora"])[2:]
    resumed, straight = adapter(runs["resumed"]), adapter(runs["qlora"])
    assert resumed.keys() == straight.keys() and all(torch.equal(resumed[key], straight[key]) for key in straight)


def dequantized_base(folder) -> nn.Module:
    """The base as the run computes with it: every linear weight of the decoder layers through NF4 and back."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for name, module in model.named_modules():
        if type(module) is nn.Linear and ".layers." in name:
            module.weight.data = to_nf4(module.weight.detach(), 64, 256).get_original_weight()
    return model


def test_merged_and_adapter_folders_give_the_trained_logits(runs, nf4_llama, bare_tokenizer):
    trained = torch.load(runs["qlora"] / "logits.pt")
    merged = AutoModelForCausalLM.from_pretrained(runs["qlora"] / "hf", dtype=torch.float32)
    assert not any("lora" in key for key in load_file(runs["qlora"] / "hf" / "model.safetensors"))
    torch.testing.assert_close(probe_logits(merged, bare_tokenizer), trained, rtol=0, atol=1e-5)
    with_adapter = PeftModel.from_pretrained(dequantized_base(nf4_llama), runs["qlora"] / "adapter")
    torch.testing.assert_close(probe_logits(with_adapter, bare_tokenizer), trained, rtol=0, atol=1e-5)


def test_offline_export_merges_onto_the_same_dequantized_base(runs, tmp_path):
    last = runs["qlora"] / "checkpoints" / "global_step_4"
    assert cli_main(["export", str(last), str(tmp_path / "merged"), "--merge"]) == 0
    offline, trained = load_file(tmp_path / "merged" / "model.safetensors"), load_file(runs["qlora"] / "hf" /
                                                                                         "model.safetensors")
    assert offline.keys() == trained.keys()
    for name in trained:
        torch.testing.assert_close(offline[name], trained[name], rtol=0, atol=1e-6, msg=name)
