"""Ulysses context parallelism (fp32, 2 processes in one launch): cp=2 gives the per-step losses (1e-5
relative) and the step-1 gradients (1e-5 relative to the largest entry) of cp=1, for a Llama with
fewer key/value heads than cp and for Qwen2, with padded sft batches, packed sequences and lengths
that are not a multiple of cp, with sdpa and eager, and with packed sequences attended document
span by document span; dp=2,cp=1 and dp=1,cp=2 agree on the same global batch. Invalid layouts are
refused before anything starts."""


import pytest
import torch
import yaml
from transformers import GptOssConfig, LlamaConfig, LlamaForCausalLM

from llmtune.run.cli import main as cli_main
from tests.dist.case_worker import run_case
from tests.helpers import cases_launched, read_metrics, save_tiny_model

# name: (model, packing, attention backend, extra overrides of the 2-process run, tokens per attention call in
# the cp run: 0 for the default, which these short sequences never reach)
CASES = {"llama_kv1_padded": ("llama_kv1", False, "sdpa", ["parallel.cp_size=2"], 0),
         "llama_kv1_packed": ("llama_kv1", True, "sdpa", ["parallel.cp_size=2"], 0),
         "qwen2_packed": ("qwen2", True, "sdpa", ["parallel.cp_size=2"], 0),
         "llama_kv1_padded_dp2": ("llama_kv1", False, "sdpa",
                                  ["parallel.cp_size=1", "train.gradient_accumulation_steps=1"], 0),
         "llama_kv1_packed_eager": ("llama_kv1", True, "eager", ["parallel.cp_size=2"], 0),
         "qwen2_packed_document_spans": ("qwen2", True, "sdpa", ["parallel.cp_size=2"], 64)}


@pytest.fixture(scope="module")
def models(bare_tokenizer, tiny_qwen2, tmp_path_factory):
    """A Llama with fewer key/value heads (1) than cp ranks, and Qwen2."""
    llama = save_tiny_model(tmp_path_factory.mktemp("llama_kv1"), LlamaForCausalLM, bare_tokenizer,
                            num_key_value_heads=1, tie_word_embeddings=False)
    return {"llama_kv1": str(llama), "qwen2": str(tiny_qwen2)}


def recipe(root, model, sft_file, packing, attention="sdpa") -> str:
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"name_or_path": model, "attn_implementation": attention},
        "data": {"train_files": [str(sft_file)], "chat_template": "basic", "packing": packing, "max_seq_len": 96},
        "train": {"output_dir": str(root / "out"), "max_steps": 4, "per_device_train_batch_size": 2,
                  "gradient_accumulation_steps": 2, "logging_steps": 1, "learning_rate": 2e-3, "chunk_loss_size": 0},
        "checkpoint": {"export_hf": False},
    }))
    return str(path)


@pytest.fixture(scope="module")
def runs(models, sft_file, tmp_path_factory):
    references, cases = {}, []
    for name, (model, packing, attention, overrides, window) in CASES.items():
        root = tmp_path_factory.mktemp(name)
        cases.append({"recipe": recipe(root, models[model], sft_file, packing, attention), "overrides": overrides,
                      "out": str(root / "out"), "document_window": window})
    # The one-rank references train in this process while the 2-process launch runs: most of the launch is its
    # workers' start-up (importing torch, transformers, datasets).
    with cases_launched(cases, tmp_path_factory.mktemp("cases")):
        for model, packing, attention, _, _ in CASES.values():
            key = (model, packing, attention)
            if key not in references:
                ref_root = tmp_path_factory.mktemp(f"ref_{model}_{packing}_{attention}")
                run_case(recipe(ref_root, models[model], sft_file, packing, attention), [], 1)
                references[key] = ref_root / "out"
    return {name: (references[(model, packing, attention)], case["out"])
            for (name, (model, packing, attention, _, _)), case in zip(CASES.items(), cases)}


@pytest.mark.parametrize("name", CASES)
def test_losses_and_gradients_match_one_rank(runs, name):
    reference, out = runs[name]
    from pathlib import Path

    out = Path(out)
    ref_losses = [m["loss"] for m in read_metrics(reference)]
    assert len(ref_losses) == 4
    assert [m["loss"] for m in read_metrics(out)] == pytest.approx(ref_losses, rel=1e-5)
    ref_grads, grads = torch.load(reference / "grads.pt"), torch.load(out / "grads.pt")
    for key, expected in ref_grads.items():
        scale = expected.abs().max().item()
        assert scale > 0, key
        torch.testing.assert_close(grads[key], expected, rtol=0, atol=1e-5 * scale, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("overrides, nproc, message", [
    (["parallel.cp_size=3"], 2, "parallel.cp_size: 3 does not divide the world size 2"),
    (["parallel.cp_size=2", "model.name_or_path={odd_heads}"], 2, "does not divide the model's 3 attention heads"),
    (["parallel.cp_size=4", "model.name_or_path={kv3}"], 4, "key/value heads are neither a multiple nor a divisor"),
    (["parallel.cp_size=2", "model.name_or_path={sinks}"], 2, "attention sinks are not supported"),
])
def test_invalid_layouts_are_refused_up_front(overrides, nproc, message, bare_tokenizer, sft_file, tmp_path, capsys):
    """Through the CLI's main in this process, which makes the refusal itself (one that a launched process made
    would not be read here): a bin/llmtune process would add seconds of start-up and nothing that these checks
    decide (tests/e2e/test_cli_errors.py checks what the process adds)."""
    tokenizer = bare_tokenizer
    odd = LlamaConfig(vocab_size=len(tokenizer), hidden_size=24, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=3, num_key_value_heads=3)
    kv3 = LlamaConfig(vocab_size=len(tokenizer), hidden_size=48, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=12, num_key_value_heads=3)
    sinks = GptOssConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1)
    folders = {"odd_heads": tmp_path / "odd", "kv3": tmp_path / "kv3", "sinks": tmp_path / "sinks"}
    for name, config in (("odd_heads", odd), ("kv3", kv3), ("sinks", sinks)):
        folders[name].mkdir()
        config.save_pretrained(folders[name])
        tokenizer.save_pretrained(folders[name])
    path = recipe(tmp_path, str(folders["odd_heads"]), sft_file, False)
    assert cli_main(["sft", path, *[o.format(**folders) for o in overrides], "--nproc", str(nproc)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
