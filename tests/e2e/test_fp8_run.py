"""train.fp8 in a real run, built and trained as a worker does (the launcher's refusal of a machine without float8
tensor cores is tests/unit/test_float8.py's; here the run goes on, with torch's emulated float8 matmul on the CPU,
whatever the CPU: tests/helpers.emulated_float8_matmul): a one-layer Llama of the smallest shapes torchao's rowwise
filter takes (hidden 1040, intermediate 4112: the gate and up projections, out dimension above 4096), 1 process,
bf16, FSDP2. The float8 run's losses stay within 1% of the bf16 run's (float8's rounding) without being equal (the
float8 layers computed); it checkpoints, and a run resumed from its step 2 continues its curve exactly; its export has
the bf16 run's names, dtypes and shapes. 3 + 3 + 1 steps in all."""

import pytest
import torch
import yaml
from safetensors import safe_open
from transformers import LlamaForCausalLM

from tests.dist.case_worker import run_case
from tests.helpers import emulated_float8_matmul, needs_cpu_float8, read_metrics, save_tiny_model

# three runs of a 15M-parameter model, on this CPU in torch's emulated float8 matmul
pytestmark = [pytest.mark.slow, needs_cpu_float8(on_cpu=not torch.cuda.is_available())]


@pytest.fixture(scope="module")
def runs(bare_tokenizer, assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    model = save_tiny_model(root / "model", LlamaForCausalLM, bare_tokenizer, hidden_size=1040, intermediate_size=4112,
                            num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2,
                            tie_word_embeddings=False)
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(model)},
        "data": {"train_files": [str(assets / "data" / "pt.jsonl")], "max_seq_len": 64},
        "train": {"max_steps": 3, "per_device_train_batch_size": 2, "global_batch_size": 2, "logging_steps": 1,
                  "learning_rate": 1e-4, "bf16": True},
        "checkpoint": {"export_hf": True},
        "monitor": {"console": False, "plots": False},
    }))
    out = {name: root / name for name in ("bf16", "fp8", "fp8_resumed")}
    run_case(str(recipe), [f"train.output_dir={out['bf16']}"], 1, task="pt")
    # A checkpoint of the float8 run alone, at step 2: the resumed run trains step 3 again.
    with emulated_float8_matmul():
        run_case(str(recipe), [f"train.output_dir={out['fp8']}", "train.fp8=true", "checkpoint.save_steps=2"], 1,
                 task="pt")
        run_case(str(recipe), [f"train.output_dir={out['fp8_resumed']}", "train.fp8=true",
                               "checkpoint.export_hf=false",
                               f"checkpoint.resume_from_checkpoint={out['fp8'] / 'checkpoints' / 'global_step_2'}"], 1,
                 task="pt")
    return out


def losses(output_dir) -> list[float]:
    return [record["loss"] for record in read_metrics(output_dir) if "loss" in record]


def test_float8_losses_are_near_the_bf16_ones_and_not_equal(runs):
    bf16, fp8 = losses(runs["bf16"]), losses(runs["fp8"])
    assert len(fp8) == len(bf16) == 3
    assert fp8 == pytest.approx(bf16, rel=1e-2)
    assert fp8 != bf16


def test_a_resumed_float8_run_continues_its_curve(runs):
    assert losses(runs["fp8_resumed"]) == losses(runs["fp8"])[2:]


def test_the_float8_export_is_laid_out_as_the_bf16_one(runs):
    def layout(folder):
        with safe_open(folder / "hf" / "model.safetensors", "pt") as f:
            return {name: (f.get_slice(name).get_dtype(), f.get_slice(name).get_shape()) for name in f.keys()}

    assert layout(runs["fp8"]) == layout(runs["bf16"])
    assert {dtype for dtype, _ in layout(runs["fp8"]).values()} == {"BF16"}
