"""The demo's generated assets: deterministic, a faithful tokenizer, a held-out eval set."""

import json

import pytest

from llmtune.demo.assets import write_demo_assets

DATA_FILES = ("pt.jsonl", "sft_train.jsonl", "sft_eval.jsonl", "dpo_train.jsonl", "dpo_eval.jsonl", "grpo_train.jsonl",
              "grpo_eval.jsonl")


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    a = tmp_path_factory.mktemp("demo_a")
    b = tmp_path_factory.mktemp("demo_b")
    write_demo_assets(a, seed=0)
    write_demo_assets(b, seed=0)
    return a, b


def _rows(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _samples(root):
    """A few strings straight from the data, plus an SFT exchange rendered as it is trained."""
    pt = _rows(root / "data" / "pt.jsonl")
    train = _rows(root / "data" / "sft_train.jsonl")
    evals = _rows(root / "data" / "sft_eval.jsonl")
    out = [pt[0]["text"], pt[-1]["text"], train[0]["prompt"], train[0]["response"],
           evals[0]["prompt"], evals[-1]["response"]]
    out.append(f"### Instruction:\n{train[1]['prompt']}\n\n### Response:\n{train[1]['response']}")
    return out


def test_assets_are_deterministic(roots):
    from transformers import AutoTokenizer

    a, b = roots
    for name in DATA_FILES:
        assert (a / "data" / name).read_bytes() == (b / "data" / name).read_bytes(), name
    assert (a / "model" / "config.json").read_bytes() == (b / "model" / "config.json").read_bytes()
    tok_a = AutoTokenizer.from_pretrained(a / "tokenizer")
    tok_b = AutoTokenizer.from_pretrained(b / "tokenizer")
    assert tok_a.get_vocab() == tok_b.get_vocab()
    for text in _samples(a):
        assert tok_a(text)["input_ids"] == tok_b(text)["input_ids"]


def test_tokenizer_matches_sentencepiece(roots):
    import sentencepiece as spm
    from transformers import AutoTokenizer

    root = roots[0]
    tok = AutoTokenizer.from_pretrained(root / "tokenizer")
    sp = spm.SentencePieceProcessor(model_file=str(root / "sentencepiece" / "tokenizer.model"))
    assert (tok.pad_token_id, tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (
        sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (0, 1, 2, 3)
    assert tok.pad_token == "<pad>"
    assert not tok.chat_template
    assert len(tok) == sp.get_piece_size()
    for text in _samples(root):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids, text
        assert ids == sp.encode(text), text
        assert sp.unk_id() not in ids, text
        assert tok.decode(ids) == text
        # with special tokens: bos first, nothing else added
        assert tok(text)["input_ids"] == [tok.bos_token_id] + ids


def test_eval_prompts_held_out(roots):
    root = roots[0]
    train = _rows(root / "data" / "sft_train.jsonl")
    evals = _rows(root / "data" / "sft_eval.jsonl")
    assert 100 <= len(evals) <= 200 and len(train) > len(evals)
    train_prompts = {r["prompt"] for r in train}
    assert not train_prompts & {r["prompt"] for r in evals}
    # held out by operand pair, not just by wording
    pair = lambda r: r["response"].split(" = ")[0]  # noqa: E731  "a + b"
    assert not {pair(r) for r in train} & {pair(r) for r in evals}
    for r in train + evals:
        lhs, rhs = r["response"].split(" = ")
        x, y = (int(v) for v in lhs.split(" + "))
        assert int(rhs) == x + y and f"{x}" in r["prompt"] and f"{y}" in r["prompt"]


def test_preference_pairs_prefer_the_right_sum_and_hold_out_the_eval_questions(roots):
    root = roots[0]
    train, evals = _rows(root / "data" / "dpo_train.jsonl"), _rows(root / "data" / "dpo_eval.jsonl")
    assert [r["prompt"][0]["content"] for r in evals] == [r["prompt"] for r in _rows(root / "data" / "sft_eval.jsonl")]
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in evals}
    for r in train + evals:
        (chosen,), (rejected,) = r["chosen"], r["rejected"]
        assert chosen["role"] == rejected["role"] == "assistant"
        lhs, right = chosen["content"].split(" = ")
        wrong_lhs, wrong = rejected["content"].split(" = ")
        x, y = (int(v) for v in lhs.split(" + "))
        assert int(right) == x + y and wrong_lhs == lhs and abs(int(wrong) - int(right)) in (1, 2, 10, 20)


def test_model_config_matches_tokenizer(roots):
    from transformers import AutoConfig, AutoTokenizer

    root = roots[0]
    config = AutoConfig.from_pretrained(root / "model")
    tok = AutoTokenizer.from_pretrained(root / "tokenizer")
    assert config.model_type == "llama"
    assert config.vocab_size == len(tok)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)


def test_grpo_prompts_are_the_sft_questions_with_their_sums_held_out_as_sft_holds_them_out(roots):
    root = roots[0]
    for split in ("train", "eval"):
        questions = _rows(root / "data" / f"sft_{split}.jsonl")
        prompts = _rows(root / "data" / f"grpo_{split}.jsonl")
        assert [p["prompt"] for p in prompts] == [[{"role": "user", "content": q["prompt"]}] for q in questions]
        assert [int(p["solution"]) for p in prompts] == [sum(int(v) for v in q["response"].split(" = ")[0].split(" + "))
                                                         for q in questions]
