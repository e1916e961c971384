"""LLaMA-Factory's qwen3 LoRA sft, dpo and kto examples on 2 processes (tests/e2e/test_llamafactory_recipe_run.py's
recipes, gradient_accumulation_steps 4 in place of its 8): a step trains the 8 examples the published recipe trains
on 1 process with accumulation 8, its loss that of 1 process (1e-5). One launch trains the three."""

import pytest

import llmtune
from tests.e2e.test_llamafactory_recipe_run import qwen_with_chatml, write_example  # noqa: F401 (a fixture)
from tests.helpers import launch_cases, read_metrics

EXAMPLES = {"QWEN3_LORA_SFT": ("identity", "sft", "samples"), "QWEN3_LORA_DPO": ("dpo_en_demo", "dpo", "pairs"),
            "QWEN3_LORA_KTO": ("kto_en_demo", "kto", "examples")}


@pytest.fixture(scope="module")
def runs(qwen_with_chatml, tmp_path_factory) -> dict:  # noqa: F811
    """Each example's run folder, holding `two` (2 processes) and `one` (1 process)."""
    cases, folders = [], {}
    for example, (dataset, stage, _) in EXAMPLES.items():
        folder = tmp_path_factory.mktemp(example.lower())
        recipe = write_example(example, dataset, folder, qwen_with_chatml)
        cases.append({"recipe": str(recipe), "task": stage,
                      "overrides": ["train.gradient_accumulation_steps=4", f"train.output_dir={folder / 'two'}",
                                    "train.logging_steps=1"]})
        llmtune.train(stage, str(recipe), output_dir=str(folder / "one"), logging_steps=1)
        folders[example] = folder
    launch_cases(cases, tmp_path_factory.mktemp("launch"))
    return folders


@pytest.mark.parametrize("example", list(EXAMPLES))
def test_two_processes_train_the_recipes_examples_a_step_as_one(runs, example):
    unit = EXAMPLES[example][2]
    two, one = (runs[example] / name for name in ("two", "one"))
    assert f"start: global batch 8 {unit} = micro-batch 1 x accumulation 8 x 1 data-parallel" in \
        (one / "train.log").read_text()
    # The step's loss is a mean over its 8 examples (tokens): another count of examples would change it.
    losses = [[r["loss"] for r in read_metrics(folder)] for folder in (two, one)]
    assert len(losses[1]) == 1 and losses[0] == pytest.approx(losses[1], rel=1e-5)
