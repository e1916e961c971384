"""Golden tests: for each sft format, the exact input_ids and labels, token by token.

The expected ids are built from literal text segments (what the built-in template must render),
tokenized one by one — not from the code under test."""

import pytest

from llmtune.data.formats import RowFormat, to_canonical
from llmtune.data.sft import KEPT, TOO_LONG, TRUNCATED, fit_length
from llmtune.data.templates import LabelRules, encode_prompt, encode_sample
from tests.helpers import segment_ids

IGNORE = -100


def encode(tokenizer, row, fmt, train_on_prompt=False):
    sample = to_canonical(row, RowFormat.of(fmt, list(row)), "test row")["sample"]
    return encode_sample(tokenizer, sample, LabelRules(train_on_prompt=train_on_prompt), "test row")


CASES = {
    "prompt_response": ({"prompt": "What is 2 + 3?", "response": "5"},
                        [("<s>### Instruction:\nWhat is 2 + 3?\n\n### Response:\n", False), ("5</s>", True)]),
    "alpaca": ({"instruction": "Add the numbers.", "input": "20 and 22", "output": "42", "system": "Be exact."},
               [("<s>Be exact.\n\n### Instruction:\nAdd the numbers.\n20 and 22\n\n### Response:\n", False),
                ("42</s>", True)]),
    "sharegpt": ({"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "1 + 1?"},
                                    {"from": "gpt", "value": "2"}, {"from": "human", "value": "And 2 + 2?"},
                                    {"from": "gpt", "value": "4"}]},
                 [("<s>Be brief.\n\n### Instruction:\n1 + 1?\n\n### Response:\n", False), ("2</s>", True),
                  ("### Instruction:\nAnd 2 + 2?\n\n### Response:\n", False), ("4</s>", True)]),
    "messages": ({"messages": [{"role": "user", "content": "Sum 3 and 4."}, {"role": "assistant", "content": "7"},
                               {"role": "user", "content": "Sum 7 and 8."}, {"role": "assistant", "content": "15"},
                               {"role": "user", "content": "Thanks."}]},
                 [("<s>### Instruction:\nSum 3 and 4.\n\n### Response:\n", False), ("7</s>", True),
                  ("### Instruction:\nSum 7 and 8.\n\n### Response:\n", False), ("15</s>", True)]),
}


@pytest.mark.parametrize("fmt", CASES)
def test_golden_ids_and_labels(tokenizer, fmt):
    row, segments = CASES[fmt]
    ids, labels = encode(tokenizer, row, fmt)
    want_ids, want_labels = segment_ids(tokenizer, segments)
    assert ids == want_ids
    assert labels == want_labels
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert sum(label != IGNORE for label in labels) < len(labels)


def test_train_on_prompt_labels_every_token(tokenizer):
    row, _ = CASES["sharegpt"]
    ids, labels = encode(tokenizer, row, "sharegpt", train_on_prompt=True)
    assert labels == ids


def test_prompt_used_at_inference_is_the_trained_prefix(tokenizer):
    ids, labels = encode(tokenizer, CASES["prompt_response"][0], "prompt_response")
    prompt = encode_prompt(tokenizer, "What is 2 + 3?")
    assert ids[:len(prompt)] == prompt and all(label == IGNORE for label in labels[:len(prompt)])


def test_tokenized_rows_are_used_exactly_as_given():
    tokenized = RowFormat.of("tokenized")
    assert to_canonical({"input_ids": [5, 6, 7]}, tokenized, "r") == {"input_ids": [5, 6, 7], "labels": [5, 6, 7]}
    assert to_canonical({"input_ids": [5, 6], "labels": [-100, 6]}, tokenized, "r")["labels"] == [-100, 6]


def test_truncation_cuts_the_prompt_from_the_left_and_keeps_the_response():
    ids, labels = list(range(10)), [IGNORE] * 7 + [7, 8, 9]
    assert fit_length(ids, labels, 6, "truncate_prompt") == (TRUNCATED, list(range(4, 10)), [IGNORE] * 3 + [7, 8, 9])
    assert fit_length(ids, labels, 6, "drop")[0] == TOO_LONG
    assert fit_length(ids, labels, 2, "truncate_prompt")[0] == TOO_LONG, "the response itself does not fit"
    assert fit_length(ids, labels, 10, "drop") == (KEPT, ids, labels)
