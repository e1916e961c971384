"""llmtune dpo's refusals of bad input, through the CLI: one line on stderr naming the file, row or key and the fix,
exit code 2, and nothing trained.

A recipe's problems are the launcher's, found before any process starts: checked with --nproc 2 through the CLI's
main in this process, where a refusal made by a launched worker would not be read (tests/e2e/test_cli_errors.py).
A row's problems (and rows of another task's kind, told by their columns) are found where the data is read and
tokenized, in the worker: checked on one process, through bin/llmtune, where stderr holds nothing besides the line
and datasets' progress bars of the rows read before the bad one (no traceback, no warning)."""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from tests.e2e.test_cli_errors import in_process
from tests.helpers import run_cli
from tests.unit.test_preference_data import SPACED

PROMPT = [{"role": "user", "content": "What is 2 + 3?"}]
CHOSEN = [{"role": "assistant", "content": "2 + 3 = 5"}]
REJECTED = [{"role": "assistant", "content": "2 + 3 = 6"}]
# Stands for the case's own copy of test_preference_data.SPACED (a template whose prompt rendering ends in a space
# that the whole conversation's lacks), in the recipe and in the message.
SPACED_FILE = "SPACED_FILE"


def pairs_file(folder, *rows: dict) -> str:
    """folder/pairs.jsonl: two good pairs, then `rows` (a bad row is row 3)."""
    good = {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in (good, good, *rows)))
    return str(path)


def write_recipe(folder, tiny_model, train_files: list[str], task_section: dict | None = None, **sections) -> str:
    """folder/recipe.yaml, a one-step run writing to folder/out; sections: the recipe's sections beside model, data
    and train (changes of data merged into its defaults)."""
    recipe = {"model": {"name_or_path": str(tiny_model)},
              "data": {"train_files": train_files, "chat_template": "basic", "max_seq_len": 128,
                       **sections.pop("data", {})},
              "train": {"output_dir": str(folder / "out"), "max_steps": 1, "per_device_train_batch_size": 1},
              "monitor": {"plots": False}, **sections}
    if task_section is not None:
        recipe["dpo"] = task_section
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


# datasets' progress bars (tqdm's: "read pairs.jsonl:  67%|######6   | 2/3 [...]", "Generating train split: 3
# examples [...]"), which a worker shows while it reads the rows, before it finds a bad one.
PROGRESS_BAR = re.compile(r"\d+%\||\d+ examples \[")


def one_line(result, expected: str) -> None:
    """Exit code 2, nothing on stdout, and on stderr the one line `expected` (besides datasets' progress bars)."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stdout == ""
    lines = [line for line in result.stderr.splitlines() if line.strip() and not PROGRESS_BAR.search(line)]
    assert lines == [f"llmtune: error: {expected}"], result.stderr[-3000:]


@pytest.mark.parametrize("task, sections, expected", [
    ("dpo", {"task_section": {"reference": "adapter_off"}},
     "dpo.reference: adapter_off is the policy with its adapters off, and this run trains no adapters; set "
     "peft.method (lora or dora) or dpo.reference: model"),
    ("sft", {"task_section": {"beta": 0.2}},
     "dpo: this section is for llmtune dpo, not sft; leave it out of a sft recipe"),
])
def test_a_recipes_problem_is_refused_before_any_process_starts(tmp_path, tiny_model, capsys, task, sections,
                                                                 expected):
    recipe = write_recipe(tmp_path, tiny_model, [pairs_file(tmp_path)], **sections)
    one_line(in_process(capsys, task, recipe, "--nproc", "2"), expected)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["data", "plan"])
def test_a_dpo_recipe_read_as_sfts_by_data_or_plan_is_answered_with_task_dpo(tmp_path, tiny_model, capsys, command):
    """Those commands read a recipe as sft's unless --task says otherwise: the section stays, the task is named."""
    recipe = write_recipe(tmp_path, tiny_model, [pairs_file(tmp_path)], task_section={"beta": 0.2})
    one_line(in_process(capsys, command, recipe), "dpo: this section is for llmtune dpo, not sft; pass --task dpo")


# name: (the bad row, the task, the recipe's sections, the error after the data file's name)
ROW_REFUSALS = {
    "missing_chosen": ({"prompt": PROMPT, "rejected": REJECTED}, "dpo", {},
                       "row 3: field 'chosen' is missing; every pair needs a chosen and a rejected response "
                       "(data.format prompt_chosen_rejected)"),
    "null_rejected": ({"prompt": PROMPT, "chosen": CHOSEN, "rejected": None}, "dpo", {},
                      "row 3: field 'rejected' is missing; every pair needs a chosen and a rejected response "
                      "(data.format prompt_chosen_rejected)"),
    "empty_chosen": ({"prompt": PROMPT, "chosen": [], "rejected": REJECTED}, "dpo", {},
                     "row 3: field 'chosen' is empty; every pair needs a chosen and a rejected response "
                     "(data.format prompt_chosen_rejected)"),
    "shifting_prompt": ({"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}, "dpo",
                        {"data": {"chat_template": SPACED_FILE}},
                        f"row 1: data.chat_template '{SPACED_FILE}' renders the prompt differently once the chosen "
                        "response follows it: token 13 of the prompt (rendered with add_generation_prompt) is '▁', of "
                        "the prompt + chosen '###', so the response cannot be told from the prompt; set "
                        "data.chat_template to a template whose prompt rendering begins the whole conversation's"),
    "too_long": ({"prompt": PROMPT, "chosen": [{"role": "assistant", "content": " ".join(["5"] * 40)}],
                  "rejected": REJECTED}, "dpo", {"task_section": {"truncation": False}},
                 "row 3: the prompt (14 tokens) and the longer response (80 tokens; chosen 80, rejected 8) make a "
                 "sequence of 94 tokens, over the 64 of dpo.max_length (default data.max_seq_len / 2); raise "
                 "dpo.max_length (and data.max_seq_len, which holds two), set dpo.max_prompt_length, or set "
                 "dpo.truncation: true to cut it"),
    "pairs_for_sft": ({"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}, "sft", {},
                      "preference data (chosen/rejected columns, or ranking: true) is for llmtune dpo or llmtune rm, not sft; "
                      "train it with llmtune dpo or llmtune rm, or leave it out of data.train_files"),
}


@pytest.fixture(scope="module")
def row_refusals(tmp_path_factory, tiny_model) -> dict:
    """name: (its folder, its data file, bin/llmtune's result) of each ROW_REFUSALS case on one process, launched
    side by side: most of a launch is its start-up (importing torch, transformers, datasets), one core's work."""
    cases = {}
    for name, (row, task, sections, _) in ROW_REFUSALS.items():
        folder = tmp_path_factory.mktemp(name)
        data = pairs_file(folder, row)
        if sections.get("data", {}).get("chat_template") == SPACED_FILE:
            (folder / "spaced.jinja").write_text(SPACED)
            sections = {**sections, "data": {"chat_template": str(folder / "spaced.jinja")}}
        cases[name] = (folder, data, [task, write_recipe(folder, tiny_model, [data], **sections)])
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda case: run_cli(*case[2]), cases.values()))
    return {name: (folder, data, result) for (name, (folder, data, _)), result in zip(cases.items(), results)}


@pytest.mark.slow
@pytest.mark.parametrize("name", ROW_REFUSALS)
def test_a_bad_row_is_named_by_the_worker_of_a_one_process_run(row_refusals, name):
    folder, data, result = row_refusals[name]
    one_line(result, f"{data}: {ROW_REFUSALS[name][3].replace(SPACED_FILE, str(folder / 'spaced.jinja'))}")
    assert not (folder / "out" / "metrics.jsonl").exists()
