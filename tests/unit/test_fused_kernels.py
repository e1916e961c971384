"""train.fused_kernels: Liger's CUDA kernels against the reference path (on CUDA with liger-kernel only), and the
refusals and settings that hold on every machine."""

import copy
import importlib.util
from types import SimpleNamespace

import pytest
import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama

from llmtune.config import TrainConfig
from llmtune.features.base import Features
from llmtune.features.fused_kernels import FusedKernels
from llmtune.model.build import CausalLMForTraining
from llmtune.model.loss import IGNORE_INDEX, LossOptions, cross_entropy_sum, shift_labels
from llmtune.run.cli import main as cli_main

needs_cuda_and_liger = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("liger_kernel") is None,
    reason="compares Liger's kernels with the reference path: needs a CUDA device and liger-kernel")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal needs a machine without CUDA")

NO_CUDA = ("train.fused_kernels: Liger's kernels run on CUDA only and this machine has none; set "
           "train.fused_kernels: false")
# Large enough that an option Liger computed differently, or dropped, fails the comparison below (random logits here
# are ~0.3 in size, lse ~7): the z-loss adds ~7% to the loss and ~14% to the logits' gradients, the smoothing moves
# the lm_head's gradients by ~10%, a cap of 1 scales the logits' gradients by ~0.9.
OPTIONS = dict(z_loss=1e-2, label_smoothing=0.1)


def recipe(**train):
    return SimpleNamespace(train=TrainConfig(output_dir="out", **train))


@pytest.fixture
def llama_module_restored():
    """Liger's patching replaces functions and classes of transformers' llama module for the whole process: put
    them back for the tests that follow."""
    saved = dict(vars(modeling_llama))
    yield
    vars(modeling_llama).update(saved)


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """The norm of the difference over the reference's: elements rounded differently do not fail it alone."""
    return ((value.float() - reference.float()).norm() / reference.float().norm()).item()


def assert_within_bf16_error(fused: torch.Tensor, reference: torch.Tensor, exact: torch.Tensor, name: str) -> None:
    """bf16's error, measured rather than guessed: the fused path may be at most twice as far from the fp32 value
    (`exact`) as the reference path in bf16 is, plus 2^-8 (one bf16 rounding) for the values the reference gets
    almost exactly. Some gradients are far noisier than others (k_proj's, tiny at initialisation, are ~1.5% off in
    bf16), so one fixed tolerance would be either too loose for most or too tight for those. On CPU, the reference's
    two bf16 paths (full logits, chunked) stay under half of this bound, and dropping the z-loss, the
    smoothing or the cap, or leaving a gradient unscaled by grad_output, exceeds it 6 to 5,000 times."""
    error, bound = relative_error(fused, exact), 2 * relative_error(reference, exact) + 2**-8
    assert error <= bound, f"{name}: {error:.3g} from the fp32 value, more than {bound:.3g}"


def loss_and_grads(hf_model, options: LossOptions, input_ids, labels) -> dict[str, torch.Tensor]:
    """The summed loss through llmtune's model ("loss"), and every parameter's gradient of it divided by the
    labelled tokens, as the trainer divides it (so that Liger scales its gradients by a grad_output that is not 1)."""
    loss = CausalLMForTraining(hf_model, options, Features([]))(input_ids, shift_labels=labels)
    (loss / (labels != IGNORE_INDEX).sum()).backward()
    return {"loss": loss.detach(), **{name: param.grad for name, param in hf_model.named_parameters()}}


@pytest.mark.cuda
@needs_cuda_and_liger
@pytest.mark.parametrize("softcap", [None, 1.0])
def test_fused_kernels_give_the_reference_loss_and_gradients(llama_module_restored, softcap):
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=512)
    exact_model = LlamaForCausalLM(config).to("cuda")
    reference_model = copy.deepcopy(exact_model).to(torch.bfloat16)
    fused_model = copy.deepcopy(reference_model)
    input_ids = torch.randint(config.vocab_size, (2, 64), device="cuda")
    labels = input_ids.clone()
    labels[:, :16] = IGNORE_INDEX  # a prompt
    labels = shift_labels(labels)
    options = LossOptions(chunk_size=1024, logit_softcap=softcap, **OPTIONS)
    # The reference paths run first: Liger's RoPE replaces the llama module's function, which every llama model calls.
    exact = loss_and_grads(exact_model, options, input_ids, labels)
    reference = loss_and_grads(reference_model, options, input_ids, labels)
    FusedKernels(recipe(fused_kernels=True)).build(fused_model, state=None)
    assert fused_model.model.norm._get_name() == "LigerRMSNorm"
    assert fused_model.model.layers[0].mlp._get_name() == "LigerSwiGLUMLP"
    assert modeling_llama.apply_rotary_pos_emb is liger_rotary_pos_emb
    fused = loss_and_grads(fused_model, LossOptions(fused=True, logit_softcap=softcap, **OPTIONS), input_ids, labels)
    for name in exact:
        assert_within_bf16_error(fused[name], reference[name], exact[name], name)


@pytest.mark.cuda
@needs_cuda_and_liger
def test_the_fused_loss_alone_in_evaluation_with_lm_head_alone_trained_and_without_labels():
    torch.manual_seed(0)
    hidden = torch.randn(128, 256, device="cuda")
    weight = (0.02 * torch.randn(1000, 256, device="cuda")).requires_grad_()
    labels = torch.randint(1000, (128,), device="cuda")
    labels[:32] = IGNORE_INDEX
    options = LossOptions(chunk_size=1024, **OPTIONS)
    exact_loss = cross_entropy_sum(hidden, weight, None, labels, options)
    exact_grad, = torch.autograd.grad(exact_loss, weight)
    hidden, weight = hidden.bfloat16(), weight.detach().bfloat16().requires_grad_()
    reference_loss = cross_entropy_sum(hidden, weight, None, labels, options)
    reference_grad, = torch.autograd.grad(reference_loss, weight)
    fused = LossOptions(fused=True, **OPTIONS)
    with torch.no_grad():  # evaluation
        assert_within_bf16_error(cross_entropy_sum(hidden, weight, None, labels, fused), reference_loss, exact_loss,
                                 "loss without grad mode")
    # hidden needs no gradient, as when only lm_head trains: Liger gives the weight one only when hidden needs one.
    fused_loss = cross_entropy_sum(hidden, weight, None, labels, fused)
    assert_within_bf16_error(fused_loss, reference_loss, exact_loss, "loss")
    assert_within_bf16_error(torch.autograd.grad(fused_loss, weight)[0], reference_grad, exact_grad, "lm_head")
    loss = cross_entropy_sum(hidden, weight, None, torch.full_like(labels, IGNORE_INDEX), fused)
    assert loss.item() == 0 and not torch.autograd.grad(loss, weight)[0].any()


def test_the_recipe_key_turns_the_feature_and_the_fused_loss_on():
    for on in (False, True):
        config = recipe(fused_kernels=on)
        assert FusedKernels.enabled(config) is on
        assert LossOptions.of_run(config.train, LlamaConfig()).fused is on


@no_cuda
def test_a_machine_without_cuda_is_refused():
    assert FusedKernels.check(recipe(fused_kernels=True), LlamaConfig(), 1) == [NO_CUDA]


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is not None, reason="the refusal needs no liger-kernel")
def test_a_missing_liger_kernel_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert FusedKernels.check(recipe(fused_kernels=True), LlamaConfig(), 1) == [
        "train.fused_kernels: liger-kernel is not installed; pip install liger-kernel, or set train.fused_kernels: "
        "false"]


@no_cuda
def test_the_cli_refuses_fused_kernels_before_any_process_starts(tmp_path, tiny_model, sft_file, capsys):
    """Through the CLI's main in this process, which makes the refusal itself (one that a launched process made
    would not be read here); tests/e2e/test_cli_errors.py checks what a bin/llmtune process adds."""
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(tiny_model)},
        "data": {"train_files": [str(sft_file)], "chat_template": "basic"},
        "train": {"output_dir": str(tmp_path / "out"), "max_steps": 1, "fused_kernels": True}}))
    code, stderr = cli_main(["sft", str(recipe_file), "--nproc", "2"]), capsys.readouterr().err
    assert code == 2, stderr
    assert stderr.strip().splitlines() == [f"llmtune: error: {NO_CUDA}"]
    assert not (tmp_path / "out").exists()
