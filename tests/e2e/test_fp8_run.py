"""train.fp8 in a real run, built and trained as a worker does (the launcher's refusal of a machine without float8
tensor cores is tests/unit/test_float8.py's; here the run goes on, with torch's emulated float8 matmul on the CPU,
whatever the CPU: tests/helpers.emulated_float8_matmul): a one-layer Llama whose projections torchao's tensorwise filter
takes (hidden 1040, intermediate 4112: q, o, gate, up and down), bf16, FSDP2, the float8 runs compiled (train.fp8 needs
train.compile; traced by aot_eager, COMPILE_BACKEND), each step's weight scales computed once before its forwards. The
float8 run's losses stay within 1% of the bf16 run's (float8's rounding) without being equal (the float8 layers
computed), and on 2 processes (the weights all-gathered in float8) within 1% of 1 process's; it checkpoints, and a run
resumed from its step 2 continues its curve exactly; its export has the bf16 run's names, dtypes and shapes. 3 + 3 + 1 +
3 steps in all."""

import pytest
import torch
import torchao.float8
import yaml
from safetensors import safe_open
from transformers import LlamaForCausalLM

from llmtune.features.float8 import float8_weights
from tests.dist.case_worker import run_case
from tests.helpers import (compile_with_backend, emulated_float8_matmul, launch_cases, needs_cpu_float8, read_metrics,
                           save_tiny_model)

# three runs of a 15M-parameter model, on this CPU in torch's emulated float8 matmul
pytestmark = [pytest.mark.slow, needs_cpu_float8(on_cpu=not torch.cuda.is_available())]


FLOAT8 = ["train.fp8=true", "train.compile=true"]
# The float8 layers' graphs as inductor would get them, run by eager kernels: what is tested is the float8 training,
# not inductor's C++ builds of each graph (which took most of this file's 70 s; the device proof compiles float8
# runs with inductor on a GPU).
COMPILE_BACKEND = "aot_eager"


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
    # The float8 weights whose scales each step computes before its forwards, by run.
    precompute, scaled = torchao.float8.precompute_float8_dynamic_scale_for_fsdp, {}

    def counted(hf_model):
        precompute(hf_model)
        scaled.setdefault(run, []).append(sum(weight._precomputed_scale is not None
                                              for weight in float8_weights(hf_model)))

    # A checkpoint of the float8 run alone, at step 2: the resumed run trains step 3 again.
    with emulated_float8_matmul(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(torchao.float8, "precompute_float8_dynamic_scale_for_fsdp", counted)
        compile_with_backend(patch, COMPILE_BACKEND)
        run = "fp8"
        run_case(str(recipe), [f"train.output_dir={out['fp8']}", *FLOAT8, "checkpoint.save_steps=2"], 1, task="pt")
        run = "fp8_resumed"
        run_case(str(recipe), [f"train.output_dir={out['fp8_resumed']}", *FLOAT8,
                               "checkpoint.export_hf=false",
                               f"checkpoint.resume_from_checkpoint={out['fp8'] / 'checkpoints' / 'global_step_2'}"], 1,
                 task="pt")
    # The float8 run on 2 processes, whose FSDP2 all-gathers the weights in float8 (gloo: as bytes).
    out["fp8_2ranks"] = root / "fp8_2ranks"
    launch_cases([{"recipe": str(recipe), "task": "pt", "float8": True, "compile_backend": COMPILE_BACKEND,
                   "overrides": [f"train.output_dir={out['fp8_2ranks']}", *FLOAT8,
                                 "train.per_device_train_batch_size=1", "checkpoint.export_hf=false"]}], root)
    return out, scaled


def test_each_step_computes_the_scales_of_every_float8_weight_once(runs):
    """q, o, gate, up and down: k and v are too small for the tensorwise filter."""
    assert runs[1] == {"fp8": [5, 5, 5], "fp8_resumed": [5]}


def losses(output_dir) -> list[float]:
    return [record["loss"] for record in read_metrics(output_dir) if "loss" in record]


def test_float8_losses_are_near_the_bf16_ones_and_not_equal(runs):
    bf16, fp8 = losses(runs[0]["bf16"]), losses(runs[0]["fp8"])
    assert len(fp8) == len(bf16) == 3
    assert fp8 == pytest.approx(bf16, rel=1e-2)
    assert fp8 != bf16


def test_on_two_processes_the_float8_run_follows_its_one_process_curve(runs):
    """Within float8's rounding, not exactly: each rank scales its own micro-batch's activations."""
    assert losses(runs[0]["fp8_2ranks"]) == pytest.approx(losses(runs[0]["fp8"]), rel=1e-2)


def test_a_resumed_float8_run_continues_its_curve(runs):
    assert losses(runs[0]["fp8_resumed"]) == losses(runs[0]["fp8"])[2:]


def test_the_float8_export_is_laid_out_as_the_bf16_one(runs):
    def layout(folder):
        with safe_open(folder / "hf" / "model.safetensors", "pt") as f:
            return {name: (f.get_slice(name).get_dtype(), f.get_slice(name).get_shape()) for name in f.keys()}

    assert layout(runs[0]["fp8"]) == layout(runs[0]["bf16"])
    assert {dtype for dtype, _ in layout(runs[0]["fp8"]).values()} == {"BF16"}
