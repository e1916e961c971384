"""Shared fixtures: the demo's generated data (its preference pairs as dpo and kto take them too) and tokenizer, and
tiny models built from configs, made once per test run. Nothing is downloaded."""

import json
import os
from pathlib import Path

import pytest

# pytest-xdist's workers share the machine's cores: one intra-op thread in each, and in the runs each starts (they
# inherit it), as torchrun gives each of several ranks; set before torch is imported. Threads that outnumber the
# free cores wait for each other at every parallel operation (llmtune/run/threads.py).
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.helpers import save_tiny_model, write_pairs

DIST = Path(__file__).parent / "dist"


def pytest_collection_modifyitems(items):
    """The 2- and 4-process tests are slow by nature (each launch starts processes that import torch): marked here
    once rather than in every file, so that a new one cannot be left out of the mark."""
    for item in items:
        if DIST in Path(item.fspath).parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Path:
    """data/{pt,sft_train,sft_eval}.jsonl, tokenizer/ and model/config.json of the demo."""
    from llmtune.demo.assets import write_demo_assets

    root = tmp_path_factory.mktemp("assets")
    write_demo_assets(root)
    return root


@pytest.fixture(scope="session")
def bare_tokenizer(assets):
    """The demo's sentencepiece tokenizer as saved (no chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(assets / "tokenizer")


@pytest.fixture(scope="session")
def tiny_model(bare_tokenizer, tmp_path_factory) -> Path:
    """A random tiny Llama with GQA and untied embeddings."""
    from transformers import LlamaForCausalLM

    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), LlamaForCausalLM, bare_tokenizer,
                           num_key_value_heads=2, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_qwen2(bare_tokenizer, tmp_path_factory) -> Path:
    """A random tiny Qwen2 (attention biases, GQA)."""
    from transformers import Qwen2ForCausalLM

    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), Qwen2ForCausalLM, bare_tokenizer, seed=1,
                           num_key_value_heads=2, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tied_llama(bare_tokenizer, tmp_path_factory) -> Path:
    """A random tiny Llama whose lm_head is its input embedding."""
    from transformers import LlamaForCausalLM

    return save_tiny_model(tmp_path_factory.mktemp("tied_llama"), LlamaForCausalLM, bare_tokenizer, seed=2,
                           num_key_value_heads=2, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def nf4_llama(bare_tokenizer, tmp_path_factory) -> Path:
    """A random tiny Llama whose linear weights NF4 holds on 1 and 2 ranks: each a multiple of 2 x 16384 values
    (model.quantize's groups, a whole number of them on each of 2 ranks)."""
    from transformers import LlamaForCausalLM

    return save_tiny_model(tmp_path_factory.mktemp("nf4_llama"), LlamaForCausalLM, bare_tokenizer, seed=3,
                           hidden_size=256, intermediate_size=512, num_key_value_heads=2, tie_word_embeddings=False)


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


@pytest.fixture(scope="session")
def pairs_file(assets, tmp_path_factory):
    """48 of the demo's preference pairs, some answers lengthened so that packed rows hold 1, 2 or 3 pairs."""
    return write_pairs(assets, 48, tmp_path_factory.mktemp("pairs") / "pairs.jsonl")


@pytest.fixture(scope="session")
def examples_file(assets, tmp_path_factory):
    """The demo's first 24 preference pairs as 48 unpaired examples (TRL's form): the right sum desirable, and three in four of
    the near misses too (so that training raises the likelihood of answers in general, the mismatched ones' included:
    a reference point above 0); a third of the completions lengthened so that packed rows hold different numbers of
    examples."""
    examples = []
    for i, line in enumerate((assets / "data" / "dpo_train.jsonl").read_text().splitlines()[:24]):
        pair = json.loads(line)
        for key, label in (("chosen", True), ("rejected", i % 4 != 0)):
            completion = pair[key]
            if i % 3 == 0:
                completion = [{**completion[0], "content": " and ".join([completion[0]["content"]] * 3)}]
            examples.append({"prompt": pair["prompt"], "completion": completion, "label": label})
    path = tmp_path_factory.mktemp("kto") / "examples.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in examples))
    return path


@pytest.fixture(scope="session")
def prompts_file(assets, tmp_path_factory) -> Path:
    """eval_generation's prompts: 8 held-out questions of the demo, six as messages and two as text (TRL's two
    prompt-only forms), each with its reference answer in `response`."""
    rows = [json.loads(line) for line in (assets / "data" / "sft_eval.jsonl").read_text().splitlines()[:8]]
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": row["prompt"] if i >= 6 else [{"role": "user", "content": row["prompt"]}],
                                        "response": row["response"]}) + "\n" for i, row in enumerate(rows)))
    return path


@pytest.fixture(scope="session")
def grpo_prompts_file(assets, tmp_path_factory) -> Path:
    """grpo's prompts: 16 of the demo's held-out questions with their answers in `solution`, every other one as
    messages (TRL's two prompt-only forms)."""
    rows = [json.loads(line) for line in (assets / "data" / "sft_eval.jsonl").read_text().splitlines()[:16]]
    path = tmp_path_factory.mktemp("grpo_prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": row["prompt"] if i % 2 else [{"role": "user",
                                                                                 "content": row["prompt"]}],
                                        "solution": row["response"]}) + "\n" for i, row in enumerate(rows)))
    return path
