"""llmtune rm on one process: a zero score head gives every reward 0, the loss ln 2 and accuracy 0.5 at step 0; the
per-step losses do not depend on how many rows (holding 1, 2 or 3 pairs each) a micro-batch takes; the export is a
sequence classifier that transformers loads and that scores held-out pairs as the run did; a resumed run repeats
the uninterrupted one bitwise. (Two processes and context parallelism: tests/dist/test_rm_ranks.py.)"""

import math

import pytest
import torch

import llmtune
from tests.helpers import StopAt, read_metrics


def recipe(model, pairs, out, train=None, **sections) -> dict:
    return {
        "model": {"name_or_path": str(model)},
        "data": {"train_files": [str(pairs)], "chat_template": "basic", "max_seq_len": 128, "shuffle": False},
        "train": {"output_dir": str(out), "max_steps": 3, "per_device_train_batch_size": 1, "global_batch_size": 4,
                  "logging_steps": 1, "learning_rate": 2e-3, "per_device_eval_batch_size": 1, **(train or {})},
        "checkpoint": {"export_hf": False},
        "monitor": {"plots": False},
        **sections,
    }


@pytest.fixture(scope="module")
def zero_head_model(tiny_model, tmp_path_factory):
    """The tiny Llama as a reward model whose score head is 0: every sequence scores 0."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1)
    with torch.no_grad():
        model.score.weight.zero_()
    folder = tmp_path_factory.mktemp("zero_head")
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(folder)
    return folder


def test_a_zero_head_gives_no_reward_ln2_and_half_accuracy_at_step_zero(zero_head_model, pairs_file, tmp_path):
    llmtune.train("rm", recipe(zero_head_model, pairs_file, tmp_path, train={"max_steps": 1}))
    first = read_metrics(tmp_path)[0]
    assert abs(first["loss"] - math.log(2)) < 1e-6
    assert first["rewards/chosen"] == first["rewards/rejected"] == first["margin"] == 0.0
    assert first["accuracy"] == 0.5
    assert first["pairs_per_s"] > 0


def test_the_losses_do_not_depend_on_how_many_rows_a_micro_batch_takes(tiny_model, pairs_file, tmp_path):
    runs = {}
    for micro in (1, 2, 4):
        out = tmp_path / f"micro{micro}"
        llmtune.train("rm", recipe(tiny_model, pairs_file, out, train={"per_device_train_batch_size": micro}))
        runs[micro] = [value for r in read_metrics(out) if "loss" in r for value in (r["loss"], r["accuracy"])]
    assert len(runs[1]) == 6
    assert "48 pairs packed into 32 rows" in (tmp_path / "micro1" / "train.log").read_text()
    for micro in (2, 4):
        assert runs[micro] == pytest.approx(runs[1], rel=1e-5)


def sequences_of(row: dict) -> list[list[int]]:
    """A packed row's sequences (each begins where position_ids is 0): chosen, rejected, chosen, ..."""
    starts = [i for i, position in enumerate(row["position_ids"]) if position == 0] + [len(row["input_ids"])]
    return [row["input_ids"][a:b] for a, b in zip(starts, starts[1:])]


def test_the_export_is_a_classifier_that_scores_held_out_pairs_as_the_run_did(tiny_model, pairs_file, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from llmtune.config import load_config
    from llmtune.data.build import build_datasets
    from llmtune.data.preference import PairLimits
    from llmtune.data.templates import recipe_tokenizer

    sections = recipe(tiny_model, pairs_file, tmp_path, train={"max_steps": 4},
                      checkpoint={"export_hf": True, "export_dtype": "fp32"})
    sections["data"]["val_files"] = [str(pairs_file)]
    llmtune.train("rm", sections)
    last = [r for r in read_metrics(tmp_path) if "eval_accuracy" in r][-1]

    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert model.config.architectures == ["LlamaForSequenceClassification"] and model.config.num_labels == 1
    config = load_config(sections, [], "rm", 1)
    tokenizer = recipe_tokenizer("rm", config.model, config.data.chat_template)
    _, val, _ = build_datasets("rm", config.data, tokenizer, config.train.seed, PairLimits.of(config))
    with torch.no_grad():
        scores = [model(torch.tensor([ids])).logits[0, 0].item() for row in val for ids in sequences_of(row)]
    chosen, rejected = scores[0::2], scores[1::2]
    assert len(chosen) == 48
    won = sum((c > r) + 0.5 * (c == r) for c, r in zip(chosen, rejected))
    assert last["eval_rewards/chosen"] == pytest.approx(sum(chosen) / 48, rel=1e-5)
    assert last["eval_rewards/rejected"] == pytest.approx(sum(rejected) / 48, rel=1e-5)
    assert last["eval_accuracy"] == won / 48
    assert len({round(score, 4) for score in scores}) > 10, "the trained head scores sequences differently"


def test_a_resumed_run_repeats_the_uninterrupted_one_bitwise(tiny_model, pairs_file, tmp_path):
    sections = {"checkpoint": {"save_steps": 2, "export_hf": False}}
    whole, part = tmp_path / "whole", tmp_path / "part"
    llmtune.train("rm", recipe(tiny_model, pairs_file, whole, train={"max_steps": 4}, **sections))
    llmtune.train("rm", recipe(tiny_model, pairs_file, part, train={"max_steps": 4}, **sections),
                  callbacks=[StopAt(2)])
    llmtune.train("rm", recipe(tiny_model, pairs_file, part, train={"max_steps": 4}, **sections),
                  resume_from_checkpoint="auto")
    expected, got = ([(r["step"], r["loss"], r["margin"]) for r in read_metrics(out) if "loss" in r]
                     for out in (whole, part))
    assert len(expected) == 4 and got == expected
