"""Tensor parallelism (fp32, one launch of 4 processes): tp 2 x dp 2 gives the per-step losses and gradient norms (1e-5
relative) and the step-1 gradients (1e-5 of the largest entry) of 1 process x accumulation, with sequence
parallelism on and off (the padded Llama), padded and packed rows, on a Llama (untied, with the loss's z-loss and
label smoothing), a Qwen3 (tied embeddings, q/k norms) and a Qwen3-MoE (its experts over ep ranks of tp peers, its
router loss and experts' loads too), for dpo (log-probabilities from the vocabulary shards), for rm (a score head)
and for grpo (its completions generated on the split model, token for token the same, and a KL term against a
reference copy split likewise); tp 2 x cp 2 equals cp 1; compiled decoder layers (sequence parallelism, traced by
aot_eager: COMPILE_BACKEND) equal one process in eager; a checkpoint saved at tp 2 x dp 2 resumes at tp 1 x dp 4 and
at tp 4 on the straight run's curve, and at tp 2 x dp 2 bitwise; the export loads in transformers with the trained
logits; LoRA on split linears trains as on one process. Each refusal of a layout is made before any process
starts."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import (AutoModelForCausalLM, GPT2Config, LlamaConfig, LlamaForCausalLM, Phi3Config, Qwen3ForCausalLM,
                          Qwen3MoeForCausalLM)

from llmtune.run.cli import main as cli_main
from tests.dist.case_worker import run_case
from tests.helpers import cases_launched, read_metrics, save_tiny_model

STEPS, PROBE = 4, [5, 17, 42, 99, 7, 3, 64, 128]
SAVED = "checkpoints/global_step_2"
LOSS_OPTIONS = ["train.z_loss=0.001", "train.label_smoothing=0.1"]
# grpo: rounds of 2 prompts x 4 completions of up to 6 tokens, rewards that differ within a group, a KL term against
# a reference copy (split over the tp ranks too), a learning rate that moves the samples.
GRPO = ["grpo.reward_funcs=[regex_match,numeric_match]", "grpo.regex=.*\\d", "grpo.num_generations=4",
        "grpo.max_completion_length=6", "grpo.beta=0.1", "train.learning_rate=0.05"]
# name: (task, model, data, packing, the recipe's own overrides (the reference's too), the layout's)
CASES = {
    "llama_tp2_padded": ("sft", "llama", "sft", False, LOSS_OPTIONS, ["parallel.tp_size=2"]),
    "llama_tp2_no_sequence_parallel": ("sft", "llama", "sft", False, LOSS_OPTIONS,
                                       ["parallel.tp_size=2", "parallel.sequence_parallel=false"]),
    "qwen3_tp2_packed": ("sft", "qwen3", "sft", True, [], ["parallel.tp_size=2"]),
    "qwen3_tp2_cp2_packed": ("sft", "qwen3", "sft", True, [], ["parallel.tp_size=2", "parallel.cp_size=2"]),
    # Each decoder layer compiled (rows of changing lengths: symbolic sizes; COMPILE_BACKEND), against one process in
    # eager.
    "qwen3_tp2_packed_compiled": ("sft", "qwen3", "sft", True, [], ["parallel.tp_size=2", "train.compile=true"]),
    "llama4_tp2_saved": ("sft", "llama4", "sft", False, ["checkpoint.save_steps=2", "checkpoint.export_hf=true",
                                                         "checkpoint.export_dtype=fp32"], ["parallel.tp_size=2"]),
    "dpo_qwen3_tp2_packed": ("dpo", "qwen3", "pairs", True, [], ["parallel.tp_size=2"]),
    # LoRA on every linear, its adapters split as their base layers are, the lm_head trained in full.
    "lora_llama_tp2": ("sft", "llama", "sft", False, ["peft.method=lora", "peft.r=4", "peft.modules_to_save=[lm_head]",
                                                      "train.learning_rate=0.02", "checkpoint.export_hf=true",
                                                      "checkpoint.export_dtype=fp32"], ["parallel.tp_size=2"]),
    "grpo_llama_tp2": ("grpo", "llama", "prompts", False, GRPO, ["parallel.tp_size=2"]),
    # A sequence classifier: its score head reads the hidden states, gathered whole from the sequence's split.
    "rm_llama_tp2": ("rm", "llama", "pairs", False, [], ["parallel.tp_size=2"]),
    # The experts over 2 ranks of tp peers, each routing its half of the tokens; a dense layer among the MoE ones.
    "qwen3_moe_tp2_ep2": ("sft", "qwen3_moe", "sft", False, [], ["parallel.tp_size=2", "parallel.expert_parallel=2"]),
    # Packed pairs: no attention mask, the pads (sequence parallelism's among them) known by their sequence ids.
    "dpo_qwen3_moe_tp2_ep2_packed": ("dpo", "qwen3_moe", "pairs", True, [],
                                     ["parallel.tp_size=2", "parallel.expert_parallel=2"]),
}
# The compiled case's backend: aot_eager traces the split layers' graphs (DTensor's ops, document_sdpa) forward and
# backward as inductor would get them and runs them by eager kernels; inductor's C++ builds on 4 processes took 59 s
# of the launch's 160 (tests/e2e/test_compile_coverage.py compiles every family with inductor itself).
COMPILE_BACKEND = "aot_eager"
# Resumed from llama4_tp2_saved's step-2 checkpoint: name: the layout's overrides.
RESUMES = {"resumed_tp1_dp4": [], "resumed_tp4": ["parallel.tp_size=4"], "resumed_tp2_dp2": ["parallel.tp_size=2"]}


@pytest.fixture(scope="module")
def models(bare_tokenizer, tmp_path_factory):
    """A Llama, another with as many key/value heads as heads (4, for tp 4), a Qwen3 with tied embeddings and a
    Qwen3-MoE with a router loss."""
    root = tmp_path_factory.mktemp("tp_models")
    return {"llama": str(save_tiny_model(root / "llama", LlamaForCausalLM, bare_tokenizer, num_key_value_heads=2,
                                         tie_word_embeddings=False)),
            "llama4": str(save_tiny_model(root / "llama4", LlamaForCausalLM, bare_tokenizer, seed=3,
                                          num_key_value_heads=4, tie_word_embeddings=False)),
            "qwen3": str(save_tiny_model(root / "qwen3", Qwen3ForCausalLM, bare_tokenizer, seed=1,
                                         num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)),
            "qwen3_moe": str(save_tiny_model(root / "qwen3_moe", Qwen3MoeForCausalLM, bare_tokenizer, seed=2,
                                             hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                             num_experts=4, num_experts_per_tok=2, num_attention_heads=4,
                                             num_key_value_heads=2, head_dim=8, num_hidden_layers=3,
                                             mlp_only_layers=[1], router_aux_loss_coef=0.3,
                                             tie_word_embeddings=False))}


def recipe(root: Path, model: str, data_file, packing: bool) -> str:
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"name_or_path": model, "attn_implementation": "sdpa"},
        "data": {"train_files": [str(data_file)], "chat_template": "basic", "packing": packing, "max_seq_len": 96},
        # 8 samples (grpo: completions) a step on any layout; chunks of 16 tokens, so that the loss runs on several.
        "train": {"output_dir": str(root / "out"), "max_steps": STEPS, "per_device_train_batch_size": 2,
                  "global_batch_size": 8, "logging_steps": 1, "learning_rate": 2e-3, "chunk_loss_size": 16},
        "checkpoint": {"export_hf": False},
    }))
    return str(path)


@pytest.fixture(scope="module")
def runs(models, sft_file, pairs_file, grpo_prompts_file, tmp_path_factory):
    data = {"sft": sft_file, "pairs": pairs_file, "prompts": grpo_prompts_file}
    cases, outs = [], {}
    for name, (task, model, rows, packing, own, layout) in CASES.items():
        root = tmp_path_factory.mktemp(name)
        outs[name] = root / "out"
        cases.append({"recipe": recipe(root, models[model], data[rows], packing), "task": task,
                      "overrides": own + layout, **({"probe": PROBE} if model == "llama4" else {}),
                      **({"compile_backend": COMPILE_BACKEND} if "train.compile=true" in layout else {})})
    saved = outs["llama4_tp2_saved"]
    for name, layout in RESUMES.items():
        root = tmp_path_factory.mktemp(name)
        outs[name] = root / "out"
        cases.append({"recipe": recipe(root, models["llama4"], sft_file, False),
                      "overrides": [f"checkpoint.resume_from_checkpoint={saved / SAVED}", *layout]})
    # The one-process references train here while the launch runs.
    references = {}
    with cases_launched(cases, tmp_path_factory.mktemp("cases"), nproc=4):
        for name, (task, model, rows, packing, own, _) in CASES.items():
            key = reference_key(CASES[name])
            if key not in references:
                root = tmp_path_factory.mktemp(f"ref_{name}")
                run_case(recipe(root, models[model], data[rows], packing), own, 1, task=task,
                         probe=PROBE if model == "llama4" else None)
                references[key] = root / "out"
    return {"references": {name: references[reference_key(case)] for name, case in CASES.items()}, "outs": outs}


def reference_key(case: tuple) -> tuple:
    """What a case's one-process reference is made of: the recipe and its own overrides, not the layout's."""
    task, model, rows, packing, own, _ = case
    return task, model, rows, packing, tuple(own)


def curve(output_dir: Path) -> list[tuple[int, float, float]]:
    return [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(output_dir) if "loss" in m]


def completions(output_dir: Path) -> list[tuple[int, list[int]]]:
    return [(row["step"], row["completion_ids"]) for row in
            map(json.loads, (output_dir / "completions.jsonl").read_text().splitlines())]


@pytest.mark.parametrize("name", CASES)
def test_losses_gradient_norms_and_gradients_match_one_process(runs, name):
    reference, out = runs["references"][name], runs["outs"][name]
    expected, got = curve(reference), curve(out)
    assert [step for step, _, _ in got] == list(range(1, STEPS + 1))
    for (_, loss, norm), (_, ref_loss, ref_norm) in zip(got, expected):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert norm == pytest.approx(ref_norm, rel=1e-5)
    if CASES[name][1] == "qwen3_moe":  # the router loss of every token, and the experts' loads, as one process's
        for key in ("aux_loss", "expert_load"):
            assert [m[key] for m in read_metrics(out)] == pytest.approx([m[key] for m in read_metrics(reference)],
                                                                       rel=1e-5)
    if (reference / "completions.jsonl").exists():  # grpo's, token for token
        assert completions(out) == completions(reference)
    ref_grads, grads = torch.load(reference / "grads.pt"), torch.load(out / "grads.pt")
    assert grads.keys() == ref_grads.keys()
    assert any(value.abs().max() > 0 for value in ref_grads.values())
    # rm's gradients are those of a difference of two scores, whose cancellation leaves some weights' gradients
    # small against their rounding (the largest of a down_proj 5% of the model's): relative to the model's largest.
    largest = max(value.abs().max().item() for value in ref_grads.values())
    for key, value in ref_grads.items():
        # Relative to the largest entry; a gradient that is 0 (LoRA's A at step 1, its B starting at 0) exactly 0.
        scale = largest if CASES[name][0] == "rm" else value.abs().max().item()
        # rm's entries also get 1e-5 of themselves: a score.weight entry (a sum over every token of both rows) may
        # round 1e-5 of the largest apart on another CPU.
        rtol = 1e-5 if CASES[name][0] == "rm" else 0
        torch.testing.assert_close(grads[key], value, rtol=rtol, atol=1e-5 * scale, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("name", ["resumed_tp1_dp4", "resumed_tp4"])
def test_a_checkpoint_of_tp2_resumes_on_another_tp_degree_on_the_straight_curve(runs, name):
    straight = curve(runs["outs"]["llama4_tp2_saved"])[2:]
    resumed = curve(runs["outs"][name])
    assert [step for step, _, _ in resumed] == [3, 4]
    for (_, loss, norm), (_, ref_loss, ref_norm) in zip(resumed, straight):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert norm == pytest.approx(ref_norm, rel=1e-5)


def test_a_checkpoint_resumed_at_its_own_layout_continues_bitwise(runs):
    assert curve(runs["outs"]["resumed_tp2_dp2"]) == curve(runs["outs"]["llama4_tp2_saved"])[2:]


def test_the_export_of_a_tp_run_loads_in_transformers_with_the_trained_logits(runs):
    out = runs["outs"]["llama4_tp2_saved"]
    model = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([PROBE])).logits
    trained = torch.load(out / "logits.pt")
    torch.testing.assert_close(logits, trained, rtol=1e-5, atol=1e-5)
    # and the weights trained as one process trains them
    reference = torch.load(runs["references"]["llama4_tp2_saved"] / "logits.pt")
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)


def configs(tokenizer) -> dict:
    small = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=64)
    return {"heads3": LlamaConfig(vocab_size=len(tokenizer), **{**small, "hidden_size": 24,
                                                                  "num_attention_heads": 3, "num_key_value_heads": 3}),
            "kv2": LlamaConfig(vocab_size=len(tokenizer), **small),
            "intermediate": LlamaConfig(vocab_size=len(tokenizer), **{**small, "intermediate_size": 66}),
            "vocab": LlamaConfig(vocab_size=len(tokenizer) + 2, **small),
            "gpt2": GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=4),
            "phi3": Phi3Config(vocab_size=len(tokenizer), pad_token_id=0, **small)}


@pytest.mark.parametrize("overrides, nproc, message", [
    (["parallel.tp_size=3"], 4, "parallel.tp_size: 3 does not divide the world size 4"),
    (["parallel.tp_size=2", "parallel.cp_size=3"], 4, "parallel.cp_size: 3 x tp_size 2 does not divide the world "
                                                        "size 4"),
    (["parallel.tp_size=2", "parallel.dp_shard=4"], 4, "parallel.dp_shard: dp_replicate 1 x dp_shard 4 x cp_size 1 "
                                                         "x tp_size 2 is not the world size 4"),
    (["parallel.tp_size=2", "model.name_or_path={heads3}"], 2,
     "parallel.tp_size: 2 does not divide the model's attention heads (3)"),
    (["parallel.tp_size=4", "model.name_or_path={kv2}"], 4,
     "parallel.tp_size: 4 does not divide the model's key/value heads (2)"),
    (["parallel.tp_size=4", "model.name_or_path={intermediate}"], 4,
     "parallel.tp_size: 4 does not divide the model's intermediate size (66)"),
    (["parallel.tp_size=4", "model.name_or_path={vocab}"], 4,
     "parallel.tp_size: 4 does not divide the model's vocabulary (258)"),
    (["parallel.tp_size=2", "model.name_or_path={gpt2}"], 2,
     "parallel.tp_size: gpt2 has no tensor-parallel plan in transformers"),
    (["parallel.tp_size=2", "model.name_or_path={phi3}"], 2,
     "parallel.tp_size: phi3's tensor-parallel plan uses colwise_gather_output, rowwise_split_input, which llmtune "
     "does not lay"),
    (["parallel.tp_size=2", "peft.method=dora"], 2, "parallel.tp_size: 2 with peft.method: dora is not supported "
                                                      "yet; set parallel.tp_size 1, or peft.method: lora"),
    (["parallel.tp_size=2", "parallel.expert_parallel=4"], 2, "parallel.expert_parallel: 4 does not divide dp_shard 1 "
                                                                "x tp_size 2"),
    (["parallel.tp_size=2", "train.compile=true", "parallel.sequence_parallel=false"], 2,
     "parallel.tp_size: 2 with train.compile without parallel.sequence_parallel is not supported yet; set "
     "parallel.tp_size 1, or parallel.sequence_parallel: true"),
])
def test_layouts_tp_cannot_lay_are_refused_up_front(overrides, nproc, message, bare_tokenizer, sft_file, tmp_path,
                                                     capsys):
    """Through the CLI's main in this process, which makes the refusal itself, exit 2 before any process starts
    (tests/e2e/test_cli_errors.py checks what a bin/llmtune process adds)."""
    folders = {}
    for name, config in configs(bare_tokenizer).items():
        folders[name] = tmp_path / name
        config.save_pretrained(folders[name])
        bare_tokenizer.save_pretrained(folders[name])
    path = recipe(tmp_path, str(folders["kv2"]), sft_file, False)
    assert cli_main(["sft", path, *[o.format(**folders) for o in overrides], "--nproc", str(nproc)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_adapter_folder_of_a_tp_run_is_one_process_s(runs):
    """The adapters made whole, split as their base layers are, trained and gathered again: the folder a single
    process writes, key for key (4 steps at a learning rate of 0.02 apart by rounding)."""
    name = "lora_llama_tp2"
    got = load_file(runs["outs"][name] / "adapter" / "adapter_model.safetensors")
    expected = load_file(runs["references"][name] / "adapter" / "adapter_model.safetensors")
    assert got.keys() == expected.keys() and any("lora_B" in key for key in got)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=2e-4, msg=lambda m: f"{key}: {m}")
