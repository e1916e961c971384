"""llmtune rm on 2 processes: the per-step loss and accuracy of 2 data-parallel processes (accumulation 2), of 2
context-parallel peers (accumulation 4) and of 2 cp peers with micro-batches of 2 rows (accumulation 2) equal those of
1 process accumulating the same 4 rows a step in micro-batches of 1 (1e-5 relative), and so do the margin and the
mean rewards (1e-4 relative, 3.8e-6 absolute: TOLERANCES says why); so do the validation metrics (eval_loss,
eval_accuracy, ...), on an odd number of validation rows: the second data-parallel rank's share runs out first and it
scores a filler micro-batch (MicroBatch.emptied), which counts nothing. The 2-process runs train in one launch; the
1-process reference in pytest's own process."""

import pytest
import yaml

import llmtune
from tests.e2e.test_rm import SCORES
from tests.helpers import launch_cases, near, read_metrics

# 1 process takes a step's 4 rows in 4 micro-batches of 1 row; dp2 in 2 on each rank, cp2 in 4 sliced between the
# peers: the same micro-batches. cp2_micro2's hold 2 rows each (accumulation 2), so that a loss averaged over each
# micro-batch's pairs, rather than the step's, would differ from the others'.
LAYOUTS = {"dp2": {"parallel.cp_size": 1}, "cp2": {"parallel.cp_size": 2},
           "cp2_micro2": {"parallel.cp_size": 2, "train.per_device_train_batch_size": 2,
                          "train.per_device_eval_batch_size": 2}}
# The relative tolerance of each metric. A layout adds the step's fp32 gradients in another order (cp's slices, 2-row
# micro-batches), which changes a gradient element near 0 by much of its size, and Adam's update of that element by as
# much: after step 1 the scores drift by ~1e-6, in the direction of both sides alike too, which the loss does not see.
# The loss stays within 1e-5 (~1e-6 seen) and the accuracy exact; a margin, a difference of nearly equal rewards, and
# each side's mean reward, within 1e-4 (~2e-5 seen).
TOLERANCES = {"loss": 1e-5, "accuracy": 1e-5, "margin": 1e-4, "rewards/chosen": 1e-4, "rewards/rejected": 1e-4}
# A margin, and a mean reward, can be near 0 next to the scores they come from (|score| < SCORES), so these three get
# an absolute tolerance on the scores' scale too: the drift above, up to ~4 x fp32's epsilon x SCORES on the rewards
# (3e-7 seen with AVX-512 kernels, 5e-7 with plain SSE ones; 4e-8 on the margins; step 1's margin, -4.3e-4, differed
# by 2.8e-9), allowed 32 x (3.8e-6), which is still 600 times below the margin's change from one step to the next.
NEAR_ZERO_ULPS = {"margin": 32, "rewards/chosen": 32, "rewards/rejected": 32}
VALIDATION_PAIRS = 5


def recipe(tiny_model, pairs_file, val_file) -> dict:
    return {"model": {"name_or_path": str(tiny_model)},
            "data": {"train_files": [str(pairs_file)], "val_files": [str(val_file)], "chat_template": "basic",
                     "max_seq_len": 128, "shuffle": False}}


def settings(output_dir, **more) -> dict:
    # Evaluated at steps 2 and 3: once the scores have moved, and after a further step. AdamW's epsilon 1e-6 rather
    # than 1e-8: an element's update stays as small as its gradient where that is near 0, so that fp32's order of
    # additions (TOLERANCES) moves the scores 4 times less.
    return {"train.output_dir": str(output_dir), "train.max_steps": 3, "train.per_device_train_batch_size": 1,
            "train.global_batch_size": 4, "train.per_device_eval_batch_size": 1, "train.eval_steps": 2,
            "train.learning_rate": 2e-3, "train.adam_epsilon": 1e-6, "train.logging_steps": 1,
            "checkpoint.export_hf": False, "monitor.plots": False, **more}


@pytest.fixture(scope="module")
def val_file(pairs_file, tmp_path_factory):
    """The last pairs of pairs_file, which the 3 steps (12 of its 32 rows) never train on."""
    path = tmp_path_factory.mktemp("rm_val") / "val.jsonl"
    path.write_text("".join(line + "\n" for line in pairs_file.read_text().splitlines()[-VALIDATION_PAIRS:]))
    return path


def overrides(output_dir, **layout) -> list[str]:
    return [f"{key}={value}" for key, value in settings(output_dir, **layout).items()]


def validation_rows(sections: dict, output_dir) -> int:
    """The rows of the validation split (a pair each), as the run builds them."""
    from llmtune.config import load_config
    from llmtune.data.build import build_datasets
    from llmtune.data.preference import PairLimits
    from llmtune.data.templates import recipe_tokenizer

    config = load_config(sections, overrides(output_dir), "rm", 1)
    tokenizer = recipe_tokenizer("rm", config.model, config.data)
    return len(build_datasets("rm", config.data, tokenizer, config.train.seed, PairLimits.of(config))[1])


@pytest.fixture(scope="module")
def runs(tiny_model, pairs_file, val_file, tmp_path_factory) -> dict[str, list[dict]]:
    """Every run's records, by name: those of LAYOUTS on 2 processes, one on 1 process."""
    root = tmp_path_factory.mktemp("rm_ranks")
    sections = recipe(tiny_model, pairs_file, val_file)
    # With one row per eval micro-batch, an odd count leaves data-parallel rank 1 a filler at the end.
    assert validation_rows(sections, root / "one") % 2 == 1, "the validation pairs must pack into an odd number of rows"
    (root / "rm.yaml").write_text(yaml.safe_dump(sections))
    launch_cases([{"recipe": str(root / "rm.yaml"), "task": "rm",
                   "overrides": overrides(root / name, **layout)}
                  for name, layout in LAYOUTS.items()], root)
    llmtune.train("rm", sections, **settings(root / "one"))
    return {name: read_metrics(root / name) for name in [*LAYOUTS, "one"]}


def assert_alike(two: list[dict], one: list[dict], prefix: str = "") -> None:
    for name, rel in TOLERANCES.items():
        assert values(two, prefix + name) == near(values(one, prefix + name), SCORES, rel=rel,
                                                  ulps=NEAR_ZERO_ULPS.get(name, 0)), prefix + name


def values(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in records if key in r]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_processes_train_as_one(runs, layout):
    assert len(values(runs["one"], "loss")) == 3
    assert_alike(runs[layout], runs["one"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_processes_evaluate_as_one(runs, layout):
    assert len(values(runs["one"], "eval_loss")) == 2
    assert_alike(runs[layout], runs["one"], "eval_")
