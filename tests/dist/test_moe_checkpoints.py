"""Mixture-of-experts checkpoints as the Hub has them, on 2 processes (one launch): tiny Qwen3-MoE (3 experts, so
the ranks hold unequal shares), Mixtral (block_sparse_moe, w1/w2/w3) and DeepSeek-V3 (its router's bias is a buffer,
set to non-zero values here) folders written by save_pretrained store every expert's projections apart; llmtune
reads them through transformers' conversion, each rank reading only the experts of its shard, and gives exactly the
weights from_pretrained gives; the export of the loaded model is the folder again, tensor for tensor (names and
values). A conversion llmtune cannot apply rank by rank, and a quantized checkpoint, are refused before any
process starts, naming the class or the quantization."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, DeepseekV3Config, MixtralConfig, Qwen3MoeConfig

from llmtune.run.cli import main as cli_main
from tests.helpers import REPO

MODELS = ["qwen3_moe", "mixtral", "deepseek_v3"]
SHAPES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, tie_word_embeddings=False)


def stored(folder) -> dict[str, torch.Tensor]:
    with safe_open(folder / "model.safetensors", "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


@pytest.fixture(scope="module")
def loaded(bare_tokenizer, assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_checkpoints")
    special = dict(vocab_size=len(bare_tokenizer), bos_token_id=bare_tokenizer.bos_token_id,
                   eos_token_id=bare_tokenizer.eos_token_id, pad_token_id=bare_tokenizer.pad_token_id)
    configs = {"qwen3_moe": Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_experts=3,
                                           num_experts_per_tok=2, head_dim=8, **SHAPES, **special),
               "mixtral": MixtralConfig(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                                        **SHAPES, **special),
               "deepseek_v3": DeepseekV3Config(intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4,
                                               n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                                               q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                               qk_nope_head_dim=8, v_head_dim=8, n_group=2, topk_group=1,
                                               **{**SHAPES, "num_key_value_heads": 4}, **special)}
    for seed, (name, config) in enumerate(configs.items()):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        for key, buffer in model.named_buffers():
            if key.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape))
        model.save_pretrained(root / name)
        bare_tokenizer.save_pretrained(root / name)
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(root / "qwen3_moe")},
        "data": {"train_files": [str(assets / "data" / "pt.jsonl")], "max_seq_len": 64},
        "train": {"output_dir": str(root / "unused")},
        "checkpoint": {"export_dtype": "fp32"},
    }))
    out = root / "out"
    out.mkdir()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             str(REPO / "tests" / "dist" / "moe_load_worker.py"), str(recipe), str(out),
                             *(str(root / name) for name in MODELS)],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [json.loads(line) for line in (out / "reports.jsonl").read_text().splitlines()]
    return root, out, reports


@pytest.mark.parametrize("name", MODELS)
def test_each_rank_reads_only_its_experts_and_gets_what_from_pretrained_gives(loaded, name):
    root, _, reports = loaded
    mine = [r for r in reports if r["model"] == name]
    assert len(mine) == 2 and all(r["mismatched"] == [] for r in mine)
    sizes = {key: t.numel() * t.element_size() for key, t in stored(root / name).items()}
    total = sum(sizes.values())
    # Every stored byte of a parameter is read once over the two ranks, none twice; buffers, which FSDP does not
    # shard, by each rank; neither rank reads the whole model.
    buffers = sum(size for key, size in sizes.items() if key.endswith("e_score_correction_bias"))
    assert sum(r["bytes_read"] for r in mine) == total + buffers
    assert all(r["bytes_read"] < 0.7 * total for r in mine)


@pytest.mark.parametrize("name", MODELS)
def test_the_export_is_the_per_expert_folder_tensor_for_tensor(loaded, name):
    root, out, _ = loaded
    original, exported = stored(root / name), stored(out / name / "hf")
    assert not any(key.endswith("experts.gate_up_proj") for key in exported), "stored one expert per tensor"
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[key], original[key]) for key in original)
    reloaded = AutoModelForCausalLM.from_pretrained(out / name / "hf", dtype=torch.float32)
    assert reloaded.model.layers[1].mlp.experts.gate_up_proj.shape[0] == (3 if name == "qwen3_moe" else 4)


def refusal(model, assets, tmp_path, capsys) -> str:
    """`llmtune pt` on `model` stops before any process starts, with one line (returned); nothing is written.
    Through the CLI's main in this process: a bin/llmtune process would add seconds of start-up and nothing that
    these checks decide (tests/e2e/test_cli_errors.py checks what the process adds)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"name_or_path": str(model)},
                                      "data": {"train_files": [str(assets / "data" / "pt.jsonl")]},
                                      "train": {"output_dir": str(tmp_path / "out")}}))
    capsys.readouterr()  # what came before, as the progress bar of the model's save_pretrained: not the CLI's
    code, stderr = cli_main(["pt", str(recipe)]), capsys.readouterr().err
    assert code == 2, stderr[-2000:]
    assert stderr.strip().splitlines() == [stderr.strip()]
    assert not (tmp_path / "out").exists()
    return stderr


def test_a_conversion_llmtune_cannot_apply_rank_by_rank_is_refused_up_front(bare_tokenizer, assets, tmp_path, capsys):
    """HRM-Text stores gate and up projections fused, split on dim 0 when loaded (Chunk): a rank's rows of the
    split weight are not rows of one stored tensor."""
    config = AutoConfig.for_model("hrm_text", vocab_size=len(bare_tokenizer), hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_layers_per_stack=1, num_attention_heads=4, H_cycles=1,
                                  L_cycles=1, L_bp_cycles=[1])
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hrm")
    bare_tokenizer.save_pretrained(tmp_path / "hrm")
    error = refusal(tmp_path / "hrm", assets, tmp_path, capsys)
    assert "HrmTextForCausalLM is not supported" in error and "Chunk(dim=0)" in error


def test_a_quantized_checkpoint_is_refused_up_front(loaded, assets, tmp_path, capsys):
    """gpt-oss and DeepSeek-V3 are published quantized (MXFP4, FP8): their config says so."""
    root, _, _ = loaded
    shutil.copytree(root / "mixtral", tmp_path / "quantized")
    config = json.loads((tmp_path / "quantized" / "config.json").read_text())
    (tmp_path / "quantized" / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}}))
    error = refusal(tmp_path / "quantized", assets, tmp_path, capsys)
    assert "quantized weights (mxfp4)" in error and "dequantized" in error
