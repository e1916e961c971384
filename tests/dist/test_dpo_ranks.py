"""llmtune dpo and kto on 2 processes: under context parallelism (cp=2) every reference mode still gives rewards of
exactly 0 and the sigmoid loss ln 2 at step 0, where the policy is its reference; and the per-step losses of 2
data-parallel processes, and of 2 cp peers, equal those of 1 process accumulating the same micro-batches (1e-5
relative); kto's too (its reference point over the whole step), its step 0 a loss of 1/2 per example."""

import json
import math
from pathlib import Path

import pytest
import yaml

import llmtune
from tests.helpers import read_metrics, run_cli


@pytest.fixture(scope="module")
def pairs_file(assets, tmp_path_factory):
    """32 of the demo's preference pairs, a third of them lengthened: packed rows hold 1, 2 or 3 pairs."""
    rows = [json.loads(line) for line in (assets / "data" / "dpo_train.jsonl").read_text().splitlines()[:32]]
    for row in rows[::3]:
        for key in ("chosen", "rejected"):
            row[key][0]["content"] = " and ".join([row[key][0]["content"]] * 3)
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def recipe(tiny_model, pairs_file) -> dict:
    return {"model": {"name_or_path": str(tiny_model)},
            "data": {"train_files": [str(pairs_file)], "chat_template": "basic", "max_seq_len": 128, "shuffle": False}}


def settings(output_dir, steps: int, **more) -> dict:
    return {"train.output_dir": str(output_dir), "train.max_steps": steps, "train.per_device_train_batch_size": 1,
            "train.global_batch_size": 4, "train.learning_rate": 2e-3, "train.logging_steps": 1,
            "checkpoint.export_hf": False, "monitor.plots": False, **more}


def on_two_processes(tmp_path, recipe_dict: dict, values: dict, task: str = "dpo") -> list[dict]:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe_dict))
    result = run_cli(task, str(path), *[f"{k}={v}" for k, v in values.items()], "--nproc", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    return [r for r in read_metrics(Path(values["train.output_dir"])) if "loss" in r]


@pytest.mark.parametrize("reference, peft", [("model", "none"), ("adapter_off", "lora"), ("precomputed", "none")])
def test_every_reference_gives_no_reward_at_step_zero_under_context_parallelism(tiny_model, pairs_file, tmp_path,
                                                                                reference, peft):
    records = on_two_processes(tmp_path, recipe(tiny_model, pairs_file),
                               settings(tmp_path / "cp", 1, **{"parallel.cp_size": 2, "dpo.reference": reference,
                                                               "peft.method": peft}))
    first = records[0]
    assert abs(first["loss"] - math.log(2)) < 1e-6
    assert first["rewards/chosen"] == first["rewards/rejected"] == first["rewards/margins"] == 0.0
    assert first["rewards/accuracies"] == 0.5


@pytest.mark.parametrize("layout", [{"parallel.cp_size": 1}, {"parallel.cp_size": 2}], ids=["dp2", "cp2"])
def test_two_processes_give_the_losses_of_one(tiny_model, pairs_file, tmp_path, layout):
    two = on_two_processes(tmp_path, recipe(tiny_model, pairs_file), settings(tmp_path / "two", 3, **layout))
    llmtune.train("dpo", recipe(tiny_model, pairs_file), **settings(tmp_path / "one", 3))
    one = [r for r in read_metrics(tmp_path / "one") if "loss" in r]
    assert len(one) == len(two) == 3
    for key in ("loss", "rewards/margins", "logps/chosen"):
        assert [r[key] for r in two] == pytest.approx([r[key] for r in one], rel=1e-5, abs=1e-7), key


def test_kto_on_two_context_parallel_processes_gives_the_losses_of_one(tiny_model, tmp_path, assets):
    rows = [json.loads(line) for line in (assets / "data" / "dpo_train.jsonl").read_text().splitlines()[:16]]
    examples = [{"prompt": row["prompt"], "completion": row[key], "label": key == "chosen" or i % 4 != 0}
                for i, row in enumerate(rows) for key in ("chosen", "rejected")]
    path = tmp_path / "examples.jsonl"
    path.write_text("".join(json.dumps(example) + "\n" for example in examples))
    two = on_two_processes(tmp_path, recipe(tiny_model, path),
                           settings(tmp_path / "two", 3, **{"parallel.cp_size": 2, "train.learning_rate": 5e-3}), "kto")
    llmtune.train("kto", recipe(tiny_model, path), **settings(tmp_path / "one", 3, **{"train.learning_rate": 5e-3}))
    one = [r for r in read_metrics(tmp_path / "one") if "loss" in r]
    assert one[0]["loss"] == pytest.approx(0.5, abs=1e-7) and one[-1]["kl"] > 0
    for key in ("loss", "kl"):
        assert [r[key] for r in two] == pytest.approx([r[key] for r in one], rel=1e-5, abs=1e-7), key
