"""train.fp8: which linear layers torchao's float8 training takes (the decoder layers' large enough ones, torchao's
filter for each scaling; never the lm_head), that the swap keeps every parameter's name (checkpoints and exports
unchanged) and gathers tensorwise weights in float8, that the swapped layers compute in float8 (on this CPU, torch's
emulated float8 matmul: near the bf16 layer's output, not equal to it), that the weights' scales computed once before
a step are the ones each all-gather computes and are dropped after it, and the one-line refusals before any process
starts: a machine without float8 tensor cores (this CPU; an A100 faked), adapters, a model with no layer large enough,
a scaling torchao has not, fp8 without bf16 or without compile."""

import contextlib
from types import SimpleNamespace

import pytest
import torch
import yaml
from transformers import LlamaConfig

from llmtune.config import FLOAT8_SCALINGS, PeftConfig, TrainConfig
from llmtune.features.float8 import Float8Training, float8_layer_count, float8_linears
from llmtune.model.build import meta_model
from llmtune.run.cli import main as cli_main
from tests.helpers import emulated_float8_matmul, needs_cpu_float8

# Llama-3.2-3B's layer shapes, one layer, with a vocabulary of 4096: its lm_head [4096, 3072] would pass the filter
# were it a decoder layer's.
LLAMA_3B = LlamaConfig(vocab_size=4096, hidden_size=3072, intermediate_size=8192, num_hidden_layers=1,
                       num_attention_heads=24, num_key_value_heads=8)
# Llama-3.2-1B's: the two filters differ ([out, in]: q_proj and o_proj [2048, 2048], k_proj and v_proj [512, 2048],
# gate/up [8192, 2048], down [2048, 8192]). Tensorwise drops a layer whose in dimension is 4096 or less and out
# dimension 1024 or less (k, v); rowwise one whose out dimension is 2048 or less (q, o, k, v, down).
LLAMA_1B = LlamaConfig(vocab_size=4096, hidden_size=2048, intermediate_size=8192, num_hidden_layers=1,
                       num_attention_heads=32, num_key_value_heads=8)
TINY = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2)
# torchao's filters on the 3B's shapes ([out, in]): q_proj and o_proj [3072, 3072], gate/up [8192, 3072] and
# down [3072, 8192] are kept by both; k_proj and v_proj, [1024, 3072], by neither.
KEPT = {f"model.layers.0.{name}" for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                             "mlp.down_proj")}
KEPT_1B = {"tensorwise": KEPT, "rowwise": {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"}}


def recipe(method: str = "none", fp8: bool | str = True):
    return SimpleNamespace(train=TrainConfig(output_dir="out", bf16=True, compile=True, fp8=fp8),
                           peft=PeftConfig(method=method), model=SimpleNamespace(trust_remote_code=False))


def model(config):
    return meta_model(config, SimpleNamespace(trust_remote_code=False))


@pytest.mark.parametrize("scaling", FLOAT8_SCALINGS)
def test_the_decoder_layers_large_linears_are_taken_and_never_the_lm_head(scaling):
    assert set(float8_linears(model(LLAMA_3B), scaling)) == KEPT
    assert set(float8_linears(model(LLAMA_1B), scaling)) == KEPT_1B[scaling]
    assert float8_linears(model(TINY), scaling) == {}


@pytest.mark.parametrize("fp8", [True, *FLOAT8_SCALINGS])
def test_the_swap_takes_those_layers_and_keeps_every_parameter_name(fp8):
    """true is tensorwise, whose weights FSDP2 gathers in float8; rowwise's are gathered in bf16."""
    scaling = "tensorwise" if fp8 is True else fp8
    hf_model = model(LLAMA_1B)
    names = list(hf_model.state_dict())
    Float8Training(recipe(fp8=fp8)).build(hf_model, state=None)
    assert list(hf_model.state_dict()) == names
    swapped = {name: module for name, module in hf_model.named_modules() if type(module).__name__ == "Float8Linear"}
    assert set(swapped) == KEPT_1B[scaling]
    assert float8_layer_count(hf_model) == len(KEPT_1B[scaling])  # the start banner's count
    assert float8_layer_count(model(LLAMA_1B)) == 0
    assert {module.config.enable_fsdp_float8_all_gather for module in swapped.values()} == {scaling == "tensorwise"}
    assert {module.config.cast_config_input.scaling_granularity.value for module in swapped.values()} == {
        "tensorwise" if scaling == "tensorwise" else "axiswise"}


FLOAT8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize("scaling", FLOAT8_SCALINGS)
@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=needs_cpu_float8()),
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not FLOAT8_GPU, reason="float8 kernels of a GPU with float8 tensor cores (compute capability 8.9+)")])])
def test_a_swapped_layer_computes_in_float8(device, scaling):
    """The float8 matmul (on CPU torch's emulation, on a GPU its float8 kernels) through torchao's layer: within
    float8's rounding of the bf16 layer (e4m3 keeps 3 bits of mantissa: a few percent), and not the bf16 result."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(3072, 8192, bias=False)).to(device, torch.bfloat16)
    float8 = convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(3072, 8192, bias=False)),
                                        config=Float8LinearConfig.from_recipe_name(scaling)).to(device,
                                                                                                torch.bfloat16)
    float8.load_state_dict(reference.state_dict())
    inputs = torch.randn(32, 3072, dtype=torch.bfloat16, device=device)
    with emulated_float8_matmul() if device == "cpu" else contextlib.nullcontext():
        expected, got = reference(inputs).float(), float8(inputs).float()
    error = ((got - expected).norm() / expected.norm()).item()
    assert 1e-3 < error < 0.1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_a_machine_without_a_gpu_is_refused():
    assert Float8Training.check(recipe(), LLAMA_3B, 1) == [
        "train.fp8: float8 training needs a GPU with float8 tensor cores and this machine has none; set train.fp8: "
        "false"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_the_cli_refuses_fp8_here_in_one_line_before_any_process(tiny_model, sft_file, tmp_path, capsys):
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(tiny_model)},
        "data": {"train_files": [str(sft_file)], "chat_template": "basic"},
        "train": {"output_dir": str(tmp_path / "out"), "max_steps": 1, "bf16": True, "compile": True,
                  "fp8": True}}))
    code, stderr = cli_main(["sft", str(recipe_file), "--nproc", "2"]), capsys.readouterr().err
    assert code == 2, stderr
    assert stderr.strip().splitlines() == [
        "llmtune: error: train.fp8: float8 training needs a GPU with float8 tensor cores and this machine has none; "
        "set train.fp8: false"]
    assert not (tmp_path / "out").exists()


@pytest.fixture
def fake_gpu(monkeypatch):
    """A machine whose first GPU has the compute capability the test sets."""
    def lend(capability: tuple[int, int], name: str) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    return lend


def test_a_gpu_without_float8_tensor_cores_is_refused(fake_gpu):
    fake_gpu((8, 0), "NVIDIA A100-SXM4-80GB")
    [problem] = Float8Training.check(recipe(), LLAMA_3B, 8)
    assert problem.startswith("train.fp8: NVIDIA A100-SXM4-80GB (compute capability 8.0) has no float8 tensor cores")


def test_on_an_h100_adapters_and_small_models_are_refused_and_a_3b_shape_accepted(fake_gpu):
    fake_gpu((9, 0), "NVIDIA H100 80GB HBM3")
    assert Float8Training.check(recipe(), LLAMA_3B, 8) == []
    [problem] = Float8Training.check(recipe("lora"), LLAMA_3B, 8)
    assert "not peft.method lora" in problem
    [problem] = Float8Training.check(recipe(), TINY, 8)
    assert "none of llama's linear layers is large enough" in problem


def test_fp8_needs_bf16_and_compile_and_a_scaling_torchao_has():
    assert "train.fp8: float8 training computes in bf16 what it leaves out of float8; set train.bf16: true" in \
        TrainConfig(output_dir="out", fp8=True, compile=True).problems()
    assert ("train.fp8: float8 only pays under torch.compile, which fuses its casts and scalings; set train.compile: "
            "true, or train.fp8: false") in TrainConfig(output_dir="out", fp8="rowwise", bf16=True).problems()
    assert "train.fp8: 'rowise' is not valid; did you mean 'rowwise'?" in \
        TrainConfig(output_dir="out", fp8="rowise", bf16=True, compile=True).problems()
    assert TrainConfig(output_dir="out", fp8="tensorwise", bf16=True, compile=True).problems() == []


@pytest.fixture
def state():
    from llmtune.run.parallel import ParallelState

    state = ParallelState.initialize()
    yield state
    state.close()


@needs_cpu_float8()
def test_the_weights_scales_are_computed_once_for_the_step_as_each_gather_would_and_dropped_after(state):
    """Tensorwise, sharded by FSDP2 (one process): inside around_step every float8 weight has its scale ready, and
    the layer computes exactly what it computes without (the scale each all-gather computes from the weight); after
    it none is left (the optimizer then changes the weights)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaForCausalLM

    from llmtune.features.float8 import float8_weights

    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=1040, intermediate_size=1040,
                                            num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2))
    feature = Float8Training(recipe())
    feature.build(hf_model, state)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in hf_model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(hf_model, mp_policy=policy)
    weights = float8_weights(hf_model)
    assert len(weights) == 5  # q, o, gate, up, down: k and v are too small
    input_ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with emulated_float8_matmul(), torch.no_grad():
        dynamic = hf_model(input_ids).logits
        with feature.around_step(hf_model):
            assert all(weight._precomputed_scale is not None for weight in weights)
            precomputed = hf_model(input_ids).logits
        assert all(weight._precomputed_scale is None for weight in weights)
    assert torch.equal(precomputed, dynamic)
