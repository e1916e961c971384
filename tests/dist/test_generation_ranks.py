"""Generation from the model a run trains (eval_generation, through generation/engine.py) on 1 and 2 processes:
greedy completions are transformers' `generate` of the exported folder, token for token, for a dense model, with
LoRA (the merged export) and for a mixture of experts, also under expert parallelism; sampled completions are the
same token ids on 1 and 2 processes (each completion drawn by its own generator); a generation phase all-gathers
each sharded module once, whatever the completions' length, and leaves the model sharded as it was, its training
unchanged."""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from transformers import Qwen3MoeConfig

from llmtune.demo.assets import EOS_ID
from tests.dist.case_worker import run_case
from tests.helpers import REPO, export_greedy, read_metrics

NEW_TOKENS = 8
EOS = {EOS_ID}  # the tiny models' (the demo tokenizer's)
GREEDY = ["eval_generation.do_sample=false"]
SAMPLED = ["eval_generation.do_sample=true", "eval_generation.temperature=1.5", "eval_generation.top_k=0",
           "eval_generation.num_return_sequences=2"]
LORA = ["peft.method=lora", "peft.r=4", "peft.alpha=8", "peft.init_lora_weights=false", "checkpoint.export_merged=true"]


@pytest.fixture(scope="module")
def runs(tiny_model, bare_tokenizer, sft_file, prompts_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("generation")
    moe = root / "moe"
    Qwen3MoeConfig(vocab_size=len(bare_tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                   num_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   num_hidden_layers=2, max_position_embeddings=256, bos_token_id=bare_tokenizer.bos_token_id,
                   eos_token_id=bare_tokenizer.eos_token_id, pad_token_id=bare_tokenizer.pad_token_id
                   ).save_pretrained(moe)
    recipe = root / "recipe.yaml"
    # A small learning rate: the random model's varied greedy choices survive the two steps.
    recipe.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(tiny_model)},
        "data": {"train_files": [str(sft_file)], "max_seq_len": 96, "chat_template": "basic"},
        "train": {"max_steps": 2, "per_device_train_batch_size": 2, "global_batch_size": 4, "learning_rate": 1e-4},
        "eval_generation": {"files": [str(prompts_file)], "answer_column": "response", "max_new_tokens": NEW_TOKENS,
                            "batch_size": 3},
        "checkpoint": {"export_dtype": "fp32"},
        "monitor": {"console": False, "plots": False},
    }))
    moe_model = [f"model.config={moe}", "model.name_or_path=null", f"model.tokenizer={tiny_model}"]
    cases = {"dense": GREEDY, "lora": GREEDY + LORA, "moe": GREEDY + moe_model, "sampled": SAMPLED,
             "moe_ep": GREEDY + moe_model + ["parallel.expert_parallel=2"],
             # Three steps with an evaluation after each, and without any: the same training.
             "every_step": GREEDY + ["eval_generation.steps=1", "train.max_steps=3", "train.logging_steps=1"],
             "without": ["eval_generation.files=[]", "train.max_steps=3", "train.logging_steps=1"]}
    out = {}
    launched = []
    for name, overrides in cases.items():
        out[name, 2] = root / f"{name}_2"
        launched.append({"recipe": str(recipe), "overrides": [*overrides, f"train.output_dir={out[name, 2]}"]})
    (root / "cases.json").write_text(json.dumps(launched))
    out["gathers"] = root / "gathers.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    launch = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             str(REPO / "tests" / "dist" / "gathers_worker.py"), str(root / "cases.json"), str(recipe),
                             str(out["gathers"])], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert launch.returncode == 0, launch.stderr[-4000:]
    for name, overrides in cases.items():
        if name in ("dense", "moe", "sampled"):  # LoRA on one process: test_generation_eval.py's QLoRA run
            out[name, 1] = root / f"{name}_1"
            run_case(str(recipe), [*overrides, f"train.output_dir={out[name, 1]}"], 1)
    return out


def generations(output_dir) -> list[dict]:
    """The evaluation's completions at the run's last step (step 2)."""
    rows = [json.loads(line) for line in (output_dir / "generations.jsonl").read_text().splitlines()]
    assert {row["step"] for row in rows} == {2}
    return rows


@pytest.mark.parametrize("case", [("dense", 1), ("dense", 2), ("lora", 2), ("moe", 1), ("moe", 2), ("moe_ep", 2)])
def test_greedy_completions_are_transformers_generate_of_the_export(runs, case):
    rows = generations(runs[case])
    assert len(rows) == 8
    greedy = export_greedy(runs[case] / "hf")
    made = [greedy(row["prompt"], NEW_TOKENS) for row in rows]
    assert [row["completion_ids"] for row in rows] == made
    assert [row["truncated"] for row in rows] == [len(ids) == NEW_TOKENS and not {ids[-1]} & EOS for ids in made]
    assert len({tuple(ids) for ids in made}) > 1, "every prompt completed alike: the comparison shows little"


def test_sampled_completions_are_the_same_on_1_and_2_processes(runs):
    one, two = generations(runs["sampled", 1]), generations(runs["sampled", 2])
    assert len(one) == 16
    assert [row["completion_ids"] for row in one] == [row["completion_ids"] for row in two]
    assert [row["prompt"] for row in one] == [row["prompt"] for row in two]
    # Sampled: a prompt's two completions differ, and they are not the greedy ones.
    assert any(first["completion_ids"] != second["completion_ids"] for first, second in zip(one[::2], one[1::2]))
    greedy = [row["completion_ids"] for row in generations(runs["dense", 1])]
    assert [row["completion_ids"] for row in one[::2]] != greedy


def test_a_generation_phase_gathers_each_module_once_and_leaves_the_model_as_it_was(runs):
    report = json.loads(runs["gathers"].read_text())
    # The tiny Llama's two layers and the root: three parameter groups, one all-gather each, at any length.
    assert report["groups"] == 3
    assert [g["tokens"] for g in report["gathers"]] == [4 * 3, 4 * 9]
    assert [g["all_gathers"] for g in report["gathers"]] == [3, 3]
    assert report["resharded"] and report["layouts_kept"] and report["training"]


def test_evaluations_by_generation_leave_training_as_it_is(runs):
    every_step, without = read_metrics(runs["every_step", 2]), read_metrics(runs["without", 2])
    assert [r["step"] for r in every_step if "eval_gen/accuracy" in r] == [1, 2, 3]
    assert [r["loss"] for r in every_step] == [r["loss"] for r in without]
    assert [r["grad_norm"] for r in every_step] == [r["grad_norm"] for r in without]
