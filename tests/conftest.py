"""Shared fixtures: the demo's generated data and tokenizer, and tiny models built from configs,
made once per test run. Nothing is downloaded."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Path:
    """data/{pt,sft_train,sft_eval}.jsonl, tokenizer/ and model/config.json of the demo."""
    from llmtune.demo.assets import write_demo_assets

    root = tmp_path_factory.mktemp("assets")
    write_demo_assets(root)
    return root


@pytest.fixture(scope="session")
def tiny_model(assets, tmp_path_factory) -> Path:
    """A random tiny Llama with GQA and untied embeddings, saved with the demo tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(assets / "tokenizer")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def sft_file(assets, tmp_path_factory) -> Path:
    """64 prompt/response rows of unequal lengths."""
    rows = (assets / "data" / "sft_train.jsonl").read_text().splitlines()[:64]
    path = tmp_path_factory.mktemp("sft") / "train.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture(scope="session", autouse=True)
def data_cache(tmp_path_factory) -> Path:
    """Tokenized-data caches of the tests (and of the CLI runs they start) stay in a temporary folder."""
    import os

    path = tmp_path_factory.mktemp("llmtune_cache")
    os.environ["LLMTUNE_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(assets):
    """The demo's sentencepiece tokenizer with the built-in chat template."""
    from transformers import AutoTokenizer

    from llmtune.data.templates import apply_recipe_template

    tok = AutoTokenizer.from_pretrained(assets / "tokenizer")
    apply_recipe_template(tok, "basic")
    return tok
