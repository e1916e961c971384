"""llmtune rm on one process: a zero score head gives every reward 0, the loss ln 2 and accuracy 0.5 at step 0; the
per-step losses do not depend on how many rows (holding 1, 2 or 3 pairs each) a micro-batch takes; the export is a
sequence classifier that transformers loads and that scores held-out pairs as the run did; a resumed run repeats
the uninterrupted one bitwise. (Two processes and context parallelism: tests/dist/test_rm_ranks.py.)"""

import json
import math

import pytest
import torch
import yaml

import llmtune
from llmtune.errors import UserError
from tests.helpers import StopAt, near, read_metrics, save_tiny_model

# The magnitude of the tiny model's scores, which margins and mean rewards are computed from: its score head reads
# 32 normalized hidden values, and every score the runs here give is within 0.5 of 0 (0.004 to 0.46 seen).
SCORES = 1.0


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
    assert "48 pairs, each micro-batch's packed into one row" in \
        (tmp_path / "micro1" / "train.log").read_text()
    for micro in (2, 4):
        assert runs[micro] == pytest.approx(runs[1], rel=1e-5)


def test_pairs_that_share_their_prompt_train_as_pairs_packed_whole(tiny_model, pairs_file, tmp_path, monkeypatch):
    """Each pair's rejected sequence leaves its prompt to the chosen one's (data/collate.share_prefix): fewer tokens a
    step, the same per-step losses, accuracies, margins and held-out metrics as with every sequence packed whole."""
    from llmtune.features.base import Features

    def run(out):
        sections = recipe(tiny_model, pairs_file, out, train={"per_device_train_batch_size": 2, "eval_steps": 3})
        sections["data"]["val_files"] = [str(pairs_file)]
        llmtune.train("rm", sections)
        records = read_metrics(out)
        values = [r[key] for r in records for key in ("loss", "accuracy", "eval_loss", "eval_accuracy") if key in r]
        return values, [r["margin"] for r in records if "margin" in r], sum(r.get("input_tokens", 0) for r in records)

    shared, shared_margins, shared_tokens = run(tmp_path / "shared")
    monkeypatch.setattr(Features, "keep_shared_prefixes", lambda self: False)
    whole, whole_margins, whole_tokens = run(tmp_path / "whole")
    assert len(shared) == 3 * 2 + 2 and len(shared_margins) == 3
    assert shared == pytest.approx(whole, rel=1e-5)
    # The layouts add the scores' terms in other orders: a margin near 0 (step 1's, -4.3e-4) keeps their rounding,
    # ~fp32's epsilon x SCORES, not its own (up to 2.1e-8 seen with AVX-512 kernels and with plain SSE ones; step 1's
    # 6.5e-9 on another CPU failed 1e-5 relative). Absolute 9.5e-7 (near's 8 x EPS32 x SCORES): 45 times the
    # difference seen, 2000 times below the margin's change from one step to the next.
    assert shared_margins == near(whole_margins, SCORES)
    assert shared_tokens < 0.8 * whole_tokens


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
    tokenizer = recipe_tokenizer("rm", config.model, config.data)
    _, val, _ = build_datasets("rm", config.data, tokenizer, config.train.seed, PairLimits.of(config))
    with torch.no_grad():
        scores = [model(torch.tensor([ids])).logits[0, 0].item() for row in val for ids in sequences_of(row)]
    chosen, rejected = scores[0::2], scores[1::2]
    assert len(chosen) == 48
    won = sum((c > r) + 0.5 * (c == r) for c, r in zip(chosen, rejected))
    # A mean reward can be near 0 (a centred model's): absolute near's 8 x EPS32 x SCORES too (1.5e-9 seen).
    assert last["eval_rewards/chosen"] == near(sum(chosen) / 48, SCORES)
    assert last["eval_rewards/rejected"] == near(sum(rejected) / 48, SCORES)
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


def with_margins(pairs, folder, margin) -> str:
    """The pairs with TRL's margin column, `margin` on every row."""
    rows = [{**json.loads(line), "margin": margin} for line in pairs.read_text().splitlines()]
    path = folder / "margins.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_the_margin_column_is_subtracted_from_the_reward_difference(zero_head_model, pairs_file, tmp_path):
    llmtune.train("rm", recipe(zero_head_model, with_margins(pairs_file, tmp_path, 1.5), tmp_path / "run",
                               train={"max_steps": 1}))
    # Every reward is 0: each pair's loss is -log sigmoid(-1.5).
    assert read_metrics(tmp_path / "run")[0]["loss"] == pytest.approx(math.log1p(math.exp(1.5)), rel=1e-6)


def test_a_margin_that_is_not_a_number_is_refused_naming_the_row(tiny_model, pairs_file, tmp_path):
    with pytest.raises(UserError, match=r"margins.jsonl: row 1: field 'margin' must be a number .*, not 'wide'"):
        llmtune.train("rm", recipe(tiny_model, with_margins(pairs_file, tmp_path, "wide"), tmp_path / "run"))


def test_a_lora_run_exports_an_adapter_with_its_head_and_a_merged_classifier_that_score_alike(tiny_model, pairs_file,
                                                                                             tmp_path):
    """The adapter folder is peft's SEQ_CLS one, the score head saved in full: peft over the base model's classifier
    scores as the merged export does."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    llmtune.train("rm", recipe(tiny_model, pairs_file, tmp_path, peft={"method": "lora", "r": 4},
                               train={"learning_rate": 2e-2},
                               checkpoint={"export_hf": True, "export_merged": True, "export_dtype": "fp32"}))
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["task_type"] == "SEQ_CLS" and saved["modules_to_save"] == ["score"]
    assert "score" not in saved["target_modules"]
    merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    base = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1, dtype=torch.float32)
    base.config.pad_token_id = merged.config.pad_token_id
    adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ids = torch.tensor([[1, 40, 41, 42, 43, 2], [1, 50, 51, 52, 53, 2]])
    with torch.no_grad():
        assert torch.allclose(adapted(ids).logits, merged(ids).logits, rtol=1e-5, atol=1e-6)
    from safetensors.torch import load_file

    trained = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert any(name.endswith("lora_B.weight") and tensor.abs().max() > 0 for name, tensor in trained.items())


@pytest.fixture(scope="module")
def granite(bare_tokenizer, tmp_path_factory):
    """A tiny causal LM of a family transformers has no sequence classifier for."""
    from transformers import GraniteForCausalLM

    return save_tiny_model(tmp_path_factory.mktemp("granite"), GraniteForCausalLM, bare_tokenizer)


def test_a_family_without_a_classifier_and_eval_generation_are_refused_before_any_process_starts(
        tiny_model, granite, pairs_file, tmp_path, capsys, monkeypatch):
    from llmtune.run import launch
    from llmtune.run.cli import main

    monkeypatch.setattr(launch, "launch_local", lambda *a, **k: pytest.fail("a process was started"))
    cases = {
        "granite": (recipe(granite, pairs_file, tmp_path / "a"),
                    "model: transformers has no sequence classifier for GraniteConfig (model_type granite), so it "
                    "cannot be trained as a reward model; use a model of a family that has one (docs/models.md)"),
        "generation": ({**recipe(tiny_model, pairs_file, tmp_path / "b"),
                        "eval_generation": {"files": [str(pairs_file)]}},
                       "eval_generation.files: llmtune rm trains a sequence classifier, which generates no text; "
                       "leave eval_generation out (its validation pairs give eval_accuracy)"),
    }
    for name, (sections, expected) in cases.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(sections))
        capsys.readouterr()
        code = main(["rm", str(path), "--nproc", "2"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and err == [f"llmtune: error: {expected}"], (name, err)


def test_a_pair_without_a_rejected_response_is_refused_naming_file_row_and_field(tiny_model, tmp_path):
    no_rejected = tmp_path / "no_rejected.jsonl"
    rows = [{"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "6"}, {"prompt": "What is 2 + 4?", "chosen": "6"}]
    no_rejected.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(UserError, match=f"{no_rejected}: row 2: field 'rejected' is missing; every pair needs a "
                                        "chosen and a rejected response"):
        llmtune.train("rm", recipe(tiny_model, no_rejected, tmp_path / "run"))
