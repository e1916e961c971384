"""Generate the demo's data, tokenizer and tiny model config, with nothing downloaded.

The task is adding two two-digit numbers (operands 10..49; fixed-width operands make the skill
learnable by a 0.5M-parameter model in a couple of minutes of CPU). The pre-training corpus
states sums in plain prose ("The sum of 23 and 45 is 68.", "Ada asked: what is 23 + 45? Ben
answered: 23 + 45 = 68.") mixed with filler sentences. The SFT set teaches the instruction
format ("What is 23 + 45?" -> "23 + 45 = 68") on 1400 operand pairs; the 200 held-out eval
pairs never occur in it. Measured with a loop like llmtune's trainer: exact match about 0
after pre-training, above 0.8 after SFT; SFT alone from a random init reaches about 0.1.

Every output is a pure function of `seed`: same bytes every run.
"""

from __future__ import annotations

import json
import pathlib
import random
import shutil
import tempfile

MIN_OPERAND = 10
MAX_OPERAND = 49
PT_DOCS = 6000
PT_SENTENCES = (6, 12)  # sentences per document, inclusive range
PT_FILLER_FRACTION = 0.1
SFT_TRAIN_ROWS = 1400
SFT_EVAL_ROWS = 200
VOCAB_SIZE = 256

MODEL = dict(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3

# How the SFT recipe's "basic" chat template lays out one exchange (llmtune.data.templates);
# the tokenizer is trained on it too, so '#' and '\n' are pieces, not <unk>.
_EXCHANGE = "### Instruction:\n{prompt}\n\n### Response:\n{response}"

_FACT_TEMPLATES = (
    "{a} + {b} = {c}.",
    "{a} plus {b} is {c}.",
    "The sum of {a} and {b} is {c}.",
    "If you add {a} and {b}, you get {c}.",
    "Adding {b} to {a} gives {c}.",
    "{name} asked what {a} plus {b} is, and {name2} said that {a} + {b} = {c}.",
    "{name} asked: what is {a} + {b}? {name2} answered: {a} + {b} = {c}.",
)
_QUESTION_TEMPLATES = (
    "What is {a} + {b}?",
    "What is {a} plus {b}?",
    "Add {a} and {b}.",
    "Compute the sum of {a} and {b}.",
)
_NAMES = ("Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lena")
_THINGS = ("apples", "books", "coins", "shells", "stamps", "marbles", "cards", "pens")
_ADJS = ("red", "small", "old", "bright", "quiet", "green", "tall", "warm")
_PLACES = ("in the garden", "at the market", "by the river", "in the library", "at school",
           "on the hill", "near the station", "in the kitchen")
_VERBS = ("found", "painted", "carried", "lost", "counted", "sold", "washed", "hid")
_FILLER_TEMPLATES = (
    "{name} {verb} the {adj} {thing} {place}.",
    "It was a {adj} day {place}.",
    "{name} and {name2} met {place}.",
    "The {things} were {adj}, and {name} liked them.",
    "Numbers help {name} keep track of {things} {place}.",
)


def _fact(rng: random.Random, a: int, b: int) -> str:
    template = rng.choice(_FACT_TEMPLATES)
    name, name2 = rng.sample(_NAMES, 2)
    return template.format(a=a, b=b, c=a + b, name=name, name2=name2, things=rng.choice(_THINGS))


def _filler(rng: random.Random) -> str:
    names = rng.sample(_NAMES, 2)
    things = rng.choice(_THINGS)
    return rng.choice(_FILLER_TEMPLATES).format(
        name=names[0], name2=names[1], verb=rng.choice(_VERBS), adj=rng.choice(_ADJS),
        thing=things[:-1], things=things, place=rng.choice(_PLACES),
    )


def _question(rng: random.Random, a: int, b: int) -> dict:
    # The answer restates the sum as an equation: the model copies the operands (a skill the
    # corpus's question/answer sentences teach) and then adds where pre-training added.
    return {"prompt": rng.choice(_QUESTION_TEMPLATES).format(a=a, b=b),
            "response": f"{a} + {b} = {a + b}"}


def generate_data(seed: int = 0) -> tuple[list[dict], list[dict], list[dict]]:
    """(pt documents, sft train rows, sft eval rows); eval pairs never occur in sft train."""
    rng = random.Random(seed)
    operands = range(MIN_OPERAND, MAX_OPERAND + 1)
    pairs = [(a, b) for a in operands for b in operands]
    rng.shuffle(pairs)
    eval_pairs = pairs[:SFT_EVAL_ROWS]
    train_pairs = pairs[SFT_EVAL_ROWS:SFT_EVAL_ROWS + SFT_TRAIN_ROWS]
    sft_eval = [_question(rng, a, b) for a, b in eval_pairs]
    sft_train = [_question(rng, a, b) for a, b in train_pairs]

    docs = []
    for _ in range(PT_DOCS):
        sentences = []
        for _ in range(rng.randint(*PT_SENTENCES)):
            if rng.random() < PT_FILLER_FRACTION:
                sentences.append(_filler(rng))
            else:
                a, b = rng.choice(operands), rng.choice(operands)
                sentences.append(_fact(rng, a, b))
        docs.append({"text": " ".join(sentences)})
    return docs, sft_train, sft_eval


def _near_miss(rng: random.Random, total: int) -> int:
    """A wrong sum of the kind a model that almost adds makes: off by one or two in a digit."""
    return total + rng.choice((-1, 1, -2, 2)) * rng.choice((1, 10))


def preference_data(sft_train: list[dict], sft_eval: list[dict], seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(dpo train rows, dpo eval rows) in TRL's conversational preference form: the sft questions (the same operand
    pairs: the eval ones never in train), the correct equation chosen, a near miss rejected. Drawn from a generator
    of their own, so that the other files do not change."""
    rng = random.Random(seed + 1)

    def pair(row: dict) -> dict:
        equation = row["response"]
        total = int(equation.rpartition("= ")[2])
        wrong = f"{equation.rpartition('= ')[0]}= {_near_miss(rng, total)}"
        return {"prompt": [{"role": "user", "content": row["prompt"]}],
                "chosen": [{"role": "assistant", "content": equation}],
                "rejected": [{"role": "assistant", "content": wrong}]}

    return [pair(row) for row in sft_train], [pair(row) for row in sft_eval]


def grpo_prompts(rows: list[dict]) -> list[dict]:
    """grpo's prompts: the sft questions as TRL's conversational prompts, each with its sum as `solution`, the answer
    the built-in numeric_match reward compares a completion's last number with."""
    return [{"prompt": [{"role": "user", "content": row["prompt"]}], "solution": row["response"].rpartition("= ")[2]}
            for row in rows]


def _write_jsonl(path: pathlib.Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _train_tokenizer(lines: list[str], out_dir: pathlib.Path, spm_dir: pathlib.Path) -> None:
    """sentencepiece BPE model in spm_dir/tokenizer.model, converted to a transformers
    LlamaTokenizer folder in out_dir (the raw model stays for checks and for other tools)."""
    import sentencepiece as spm
    from transformers import LlamaTokenizer

    for folder in (out_dir, spm_dir):
        if folder.exists():
            shutil.rmtree(folder)
    spm_dir.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_prefix=str(pathlib.Path(tmp) / "tokenizer"),
            vocab_size=VOCAB_SIZE,
            model_type="bpe",
            character_coverage=1.0,
            split_digits=True,
            # identity + keep whitespace: "\n" in the prompt template stays a character, and
            # the transformers tokenizer converted from this model splits text identically.
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            byte_fallback=False,
            pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
            pad_piece="<pad>", unk_piece="<unk>", bos_piece="<s>", eos_piece="</s>",
            num_threads=1,
            shuffle_input_sentence=False,
            input_sentence_size=0,
            max_sentence_length=1 << 16,
            minloglevel=2,
        )
        # LlamaTokenizer(vocab_file=...) silently yields empty ids; from_pretrained on the
        # folder holding tokenizer.model converts it correctly (see TECH-NOTES).
        tokenizer = LlamaTokenizer.from_pretrained(
            tmp, pad_token="<pad>", add_bos_token=True, add_eos_token=False
        )
        shutil.copyfile(pathlib.Path(tmp) / "tokenizer.model", spm_dir / "tokenizer.model")
    tokenizer.save_pretrained(str(out_dir))


def write_demo_assets(root: pathlib.Path, seed: int = 0) -> None:
    """Write data/{pt,sft_train,sft_eval,eval_prompts,dpo_train,dpo_eval,grpo_train,grpo_eval}.jsonl, tokenizer/
    (transformers), sentencepiece/ (the raw tokenizer.model) and model/config.json under root. eval_prompts holds
    sft_eval's questions as TRL's conversational prompts with their answers, the held-out set the demo's runs generate
    from (eval_generation); grpo_train and grpo_eval the sft questions as grpo's prompts (grpo_prompts)."""
    from transformers import LlamaConfig

    root = pathlib.Path(root)
    docs, sft_train, sft_eval = generate_data(seed)
    _write_jsonl(root / "data" / "pt.jsonl", docs)
    _write_jsonl(root / "data" / "sft_train.jsonl", sft_train)
    _write_jsonl(root / "data" / "sft_eval.jsonl", sft_eval)
    _write_jsonl(root / "data" / "eval_prompts.jsonl",
                 [{"prompt": [{"role": "user", "content": row["prompt"]}], "response": row["response"]}
                  for row in sft_eval])
    dpo_train, dpo_eval = preference_data(sft_train, sft_eval, seed)
    _write_jsonl(root / "data" / "dpo_train.jsonl", dpo_train)
    _write_jsonl(root / "data" / "dpo_eval.jsonl", dpo_eval)
    for name, rows in (("grpo_train", sft_train), ("grpo_eval", sft_eval)):
        _write_jsonl(root / "data" / f"{name}.jsonl", grpo_prompts(rows))

    # The tokenizer sees the corpus and the SFT rows rendered as they are trained.
    lines = [d["text"] for d in docs]
    lines += [_EXCHANGE.format(**row) for row in sft_train]
    _train_tokenizer(lines, root / "tokenizer", root / "sentencepiece")

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        initializer_range=0.02,
        use_cache=True,
        **MODEL,
    )
    model_dir = root / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(model_dir))
