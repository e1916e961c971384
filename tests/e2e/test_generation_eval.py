"""Evaluation by generation (eval_generation) in a run: its eval_gen/<scorer> means in the records, the callbacks'
on_evaluate and llmtune.train's result, every completion with its scores in generations.jsonl; checkpoint.save_best
ranks by one; a scorer that raises or miscounts stops the run naming it, and one that cannot be imported is refused
before any process starts; pt, dpo and kto runs evaluate too, and a QLoRA run's nf4 base generates what its merged
export does."""

import json

import pytest

import llmtune
from llmtune.errors import UserError
from llmtune.run.cli import main as cli_main
from tests.helpers import export_greedy, read_metrics

SCORERS = ["accuracy", "numeric_match", "regex_match", "tests.e2e.scorer_cases:length",
           "tests.e2e.scorer_cases:unscored"]


def recipe(tiny_model, sft_file, prompts_file, output_dir, **eval_generation) -> dict:
    return {
        "model": {"name_or_path": str(tiny_model)},
        "data": {"train_files": [str(sft_file)], "chat_template": "basic", "max_seq_len": 64},
        "train": {"output_dir": str(output_dir), "max_steps": 4, "per_device_train_batch_size": 4,
                  "logging_steps": 4, "learning_rate": 2e-3},
        "eval_generation": {"files": [str(prompts_file)], "answer_column": "response", "max_new_tokens": 6,
                            "steps": 2, **eval_generation},
        "monitor": {"plots": False},
    }


@pytest.fixture(scope="module")
def scored_run(tiny_model, sft_file, prompts_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval_generation") / "run"
    given = recipe(tiny_model, sft_file, prompts_file, out, scorers=SCORERS, regex=r"\s*\d", do_sample=True,
                   num_return_sequences=2)
    given["checkpoint"] = {"save_steps": 2, "save_best": True, "best_metric": "eval_gen/length"}
    heard = HeardEvaluations()
    return llmtune.train("sft", given, callbacks=[heard]), out, heard.metrics


class HeardEvaluations:
    """A callback keeping what on_evaluate hands it."""

    def __init__(self):
        self.metrics = []

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.metrics.append(dict(metrics))


def test_the_scores_are_logged_and_every_completion_written(scored_run, prompts_file):
    result, out, heard = scored_run
    evaluations = [r for r in read_metrics(out) if "eval_gen/accuracy" in r]
    assert [r["step"] for r in evaluations] == [2, 4]
    names = {"eval_gen/accuracy", "eval_gen/numeric_match", "eval_gen/regex_match", "eval_gen/length"}
    assert names <= evaluations[-1].keys() and "eval_gen/unscored" not in evaluations[-1]
    rows = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    prompts = [json.loads(line) for line in prompts_file.read_text().splitlines()]
    assert len(rows) == 2 * 2 * len(prompts)
    for evaluation in evaluations:
        mine = [row for row in rows if row["step"] == evaluation["step"]]
        assert [row["prompt"] for row in mine] == [p["prompt"] for p in prompts for _ in range(2)]
        assert [row["response"] for row in mine] == [p["response"] for p in prompts for _ in range(2)]
        assert evaluation["eval_gen/length"] == pytest.approx(sum(row["length"] for row in mine) / len(mine))
        assert all(row["length"] == len(row["completion_ids"]) and row["unscored"] is None for row in mine)
        # The completion in its prompt's form: the assistant's message for messages, else a string.
        assert all(isinstance(row["completion"], list) == isinstance(row["prompt"], list) for row in mine)
    assert result.eval_metrics["eval_gen/length"] == evaluations[-1]["eval_gen/length"]
    assert [metrics["eval_gen/length"] for metrics in heard] == [r["eval_gen/length"] for r in evaluations]


def test_save_best_ranks_by_a_generation_metric(scored_run):
    _, out, _ = scored_run
    by_step = {r["step"]: r["eval_gen/length"] for r in read_metrics(out) if "eval_gen/length" in r}
    best = max(by_step, key=lambda step: (by_step[step], -step))
    state = json.loads((out / "checkpoints" / "best" / "trainer_state.json").read_text())
    assert state["step"] == best


@pytest.mark.parametrize("scorer, said", [
    ("raises", "eval_generation.scorers: raises raised ValueError: no answer key (scoring the completions of step 2)"),
    ("one_short", "eval_generation.scorers: one_short returned 7 values for 8 completions (scoring the completions of "
                  "step 2); return one float (or None) per completion")])
def test_a_scorer_that_fails_stops_the_run_naming_it(tiny_model, sft_file, prompts_file, tmp_path, scorer, said):
    given = recipe(tiny_model, sft_file, prompts_file, tmp_path / "run", scorers=[f"tests.e2e.scorer_cases:{scorer}"])
    with pytest.raises(UserError) as raised:
        llmtune.train("sft", given)
    assert str(raised.value) == said


def test_a_scorer_that_cannot_be_imported_is_refused_before_any_process_starts(tiny_model, sft_file, prompts_file,
                                                                               tmp_path, capsys, monkeypatch):
    """The CLI's main in this process, asked for 2 processes: it refuses before it would start them."""
    recipe_file = tmp_path / "recipe.json"
    recipe_file.write_text(json.dumps(recipe(tiny_model, sft_file, prompts_file, tmp_path / "run",
                                             scorers=["tests.e2e.no_such_scorers:score"])))
    monkeypatch.setattr("llmtune.run.launch.launch_local", lambda *args, **kwargs: pytest.fail("processes started"))
    assert cli_main(["sft", str(recipe_file), "--nproc", "2"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "llmtune: error: eval_generation.scorers: cannot import 'tests.e2e.no_such_scorers:score' (ModuleNotFoundError")
    assert not (tmp_path / "run").exists(), "nothing started"


@pytest.mark.parametrize("task", ["pt", "dpo", "kto"])
def test_every_task_evaluates_by_generation(task, tiny_model, assets, pairs_file, examples_file, prompts_file,
                                            tmp_path):
    """The evaluation is the Trainer's, not a task's: pt's documents, dpo's pairs and kto's examples train, and the
    run's model generates, as sft's does above."""
    data = {"pt": assets / "data" / "pt.jsonl", "dpo": pairs_file, "kto": examples_file}[task]
    given = recipe(tiny_model, data, prompts_file, tmp_path / "run", steps=0, max_samples=2)
    given["train"].update(max_steps=2, per_device_train_batch_size=2, global_batch_size=2)
    result = llmtune.train(task, given)
    rows = [json.loads(line) for line in (tmp_path / "run" / "generations.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [2, 2]
    assert "eval_gen/accuracy" in result.eval_metrics


def test_a_quantized_base_generates_what_its_merged_export_does(nf4_llama, sft_file, prompts_file, tmp_path):
    """QLoRA: the nf4 base with its adapters generates, greedily, transformers' generate of the merged export (the
    base dequantized, the adapters added in), token for token."""
    given = recipe(nf4_llama, sft_file, prompts_file, tmp_path / "run", steps=0)
    given["model"]["quantize"] = "nf4"
    given["peft"] = {"method": "lora", "r": 4, "alpha": 8, "init_lora_weights": False}
    given["train"].update(max_steps=2, learning_rate=1e-3)
    given["checkpoint"] = {"export_dtype": "fp32", "export_merged": True}
    llmtune.train("sft", given)
    rows = [json.loads(line) for line in (tmp_path / "run" / "generations.jsonl").read_text().splitlines()]
    greedy = export_greedy(tmp_path / "run" / "hf")
    assert len(rows) == 8
    assert [row["completion_ids"] for row in rows] == [greedy(row["prompt"], 6) for row in rows]
