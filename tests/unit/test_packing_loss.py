"""Packed rows give each sample (or document) exactly the loss it has alone: attention stays inside it,
positions restart for it, and no label crosses into the next one (fp32, 1e-5)."""

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from llmtune.config import DataConfig
from llmtune.data.build import build_datasets
from llmtune.data.collate import collate
from llmtune.features.base import Features
from llmtune.model.build import CausalLMForTraining
from llmtune.model.loss import LossOptions

QA = [{"prompt": f"What is {i} + {i * 7}?" + " Be quick." * (i % 4), "response": str(8 * i)} for i in range(24)]


@pytest.fixture(scope="module")
def model(tiny_model):
    return CausalLMForTraining(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), LossOptions(), Features([])).eval()


def per_token_loss(model, batch) -> torch.Tensor:
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.inputs.items() if k != "shift_labels"})
    labels = batch.inputs["shift_labels"]
    return F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100, reduction="none")


def spans(positions: list[int]):
    starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
    return list(zip(starts, starts[1:]))


def check_packed_rows(model, packed_rows, alone, document_mask=True):
    """Every span of every packed row has the loss of the same tokens alone; returns the largest error."""
    worst = 0.0
    for row in packed_rows:
        losses = per_token_loss(model, collate([row], pad_id=0, document_mask=document_mask))[0]
        for a, b in spans(row["position_ids"]):
            ids = row["input_ids"][a:b]
            reference = alone[tuple(ids)]
            packed = losses[a:b - 1].sum()  # the span's last label belongs to the next span: it is -100
            assert losses[b - 1] == 0
            worst = max(worst, abs(packed.item() - reference.item()) / max(abs(reference.item()), 1.0))
    return worst


def test_padding_free_sft_matches_padded_one_per_row(tmp_path, tokenizer, model):
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in QA))
    base = dict(train_files=[str(path)], max_seq_len=96, cache_dir=str(tmp_path))
    padded, _, _ = build_datasets("sft", DataConfig(packing=False, **base), tokenizer, 0)
    packed, _, _ = build_datasets("sft", DataConfig(packing=True, **base), tokenizer, 0)
    assert max(len(spans(r)) for r in packed["position_ids"]) > 1
    alone = {tuple(row["input_ids"]): per_token_loss(model, collate([row], pad_id=0))[0].sum() for row in padded}
    assert check_packed_rows(model, packed, alone) < 1e-5
    batch = collate([padded[0], padded[1], padded[2]], pad_id=0)
    in_batch = per_token_loss(model, batch).sum(dim=1)
    for i in range(3):
        assert in_batch[i].item() == pytest.approx(alone[tuple(padded[i]["input_ids"])].item(), rel=1e-5)


def test_packed_pt_matches_each_document_alone(tmp_path, tokenizer, model):
    docs = [{"text": f"{i} plus {i + 3} is {2 * i + 3}." + " It was a quiet day." * (i % 3)} for i in range(30)]
    path = tmp_path / "pt.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    packed, _, _ = build_datasets("pt", DataConfig(train_files=[str(path)], max_seq_len=64, pt_remainder="pad",
                                                   cache_dir=str(tmp_path)), tokenizer, 0)
    whole = [ids + [tokenizer.eos_token_id] for ids in tokenizer([d["text"] for d in docs])["input_ids"]]
    # Documents cut by a block edge are checked as the part inside the block, also alone.
    alone = {}
    for row in packed:
        for a, b in spans(row["position_ids"]):
            piece = row["input_ids"][a:b]
            alone[tuple(piece)] = per_token_loss(model, collate([{"input_ids": piece}], pad_id=0))[0].sum()
    assert sum(1 for ids in whole if tuple(ids) in alone) > 10, "most documents sit whole inside a block"
    assert check_packed_rows(model, packed, alone) < 1e-5
    assert check_packed_rows(model, packed, alone, document_mask=False) > 1e-3, "attention across documents differs"
