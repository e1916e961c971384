import json

import pytest
import torch
from transformers import AutoTokenizer

from llmtune.config import DataConfig, TrainConfig
from llmtune.data.collate import collate
from llmtune.data.manager import DataManager, build_dataset
from llmtune.data.templates import encode_prompt
from llmtune.errors import UserError
from llmtune.loss import IGNORE_INDEX


@pytest.fixture(scope="module")
def tokenizer(assets):
    return AutoTokenizer.from_pretrained(assets / "tokenizer")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_pt_packs_documents_with_eos_into_full_blocks(tmp_path, tokenizer):
    docs = [{"text": f"The sum of {i} and {i + 1} is {2 * i + 1}."} for i in range(40)]
    dataset = build_dataset("pt", DataConfig(max_seq_len=16), [write_jsonl(tmp_path / "pt.jsonl", docs)], tokenizer)
    stream = [t for ids in tokenizer([d["text"] for d in docs])["input_ids"] for t in ids + [tokenizer.eos_token_id]]
    blocks = dataset["input_ids"]
    assert all(len(block) == 16 for block in blocks)
    assert [t for block in blocks for t in block] == stream[:len(blocks) * 16]
    assert len(stream) - len(blocks) * 16 < 16


def test_sft_masks_prompt_and_keeps_response_and_eos(tmp_path, tokenizer):
    rows = [{"instruction": "Add 2 and 3.", "input": "", "output": "5"},
            {"instruction": "Add these.", "input": "20 and 30", "output": "50"}]
    dataset = build_dataset("sft", DataConfig(max_seq_len=64), [write_jsonl(tmp_path / "a.jsonl", rows)], tokenizer)
    for row, (prompt, answer) in zip(dataset, [("Add 2 and 3.", "5"), ("Add these.\n\n20 and 30", "50")]):
        n = len(encode_prompt(tokenizer, prompt))
        assert row["input_ids"][:n] == encode_prompt(tokenizer, prompt)
        assert row["labels"][:n] == [IGNORE_INDEX] * n
        assert row["labels"][n:] == row["input_ids"][n:]
        assert tokenizer.decode(row["labels"][n:], skip_special_tokens=True) == answer
        assert row["labels"][-1] == tokenizer.eos_token_id


def test_sft_unknown_columns_name_the_file(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "odd.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(UserError, match=r"odd.jsonl: cannot tell the sft format from the columns question, answer"):
        build_dataset("sft", DataConfig(), [path], tokenizer)


def test_collate_pads_right_and_shifts_labels():
    batch = collate([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9]}], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["shift_labels"].tolist() == [[6, 7, -100], [9, -100, -100]]


@pytest.mark.parametrize("dp_size, per_device, accumulation", [(2, 4, 1), (1, 1, 8), (2, 2, 2), (4, 1, 2)])
def test_each_step_consumes_the_same_samples_whatever_the_layout(dp_size, per_device, accumulation):
    """Step k takes the same global batch on every (ranks, micro-batch, accumulation) split."""
    dataset = [{"input_ids": [i]} for i in range(37)]

    def step_sets(dp, micro, acc):
        train = TrainConfig(per_device_train_batch_size=micro, gradient_accumulation_steps=acc, seed=1, max_steps=9)
        managers = [DataManager(dataset, DataConfig(), train, 0, dp, rank) for rank in range(dp)]
        per_rank = [list(m.steps(m.total_steps(train))) for m in managers]
        return [sorted(int(t) for _, micro_batches in (r[k] for r in per_rank) for b in micro_batches
                       for t in b["input_ids"].flatten()) for k in range(len(per_rank[0]))]

    reference = step_sets(1, 8, 1)
    assert len(reference) == 9  # 4 steps an epoch: the 9 steps cross two epoch boundaries
    assert step_sets(dp_size, per_device, accumulation) == reference
    assert reference[0] != reference[4], "a new epoch must reshuffle"
