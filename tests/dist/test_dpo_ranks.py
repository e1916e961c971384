"""llmtune dpo and kto on 2 processes: under context parallelism (cp=2) every reference mode still gives rewards of
exactly 0 and the sigmoid loss ln 2 at step 0, where the policy is its reference; and the per-step losses of 2
data-parallel processes, and of 2 cp peers, equal those of 1 process accumulating the same micro-batches (1e-5
relative), and those of 1 process with every sequence whole (data/collate.share_prefix off: the 2-process runs
compute each pair's prompt once); kto's too (its reference point over the whole step), its step 0 a loss of 1/2 per
example. Every
2-process run trains in one launch; the 1-process references in pytest's own process."""

import json
import math

import pytest
import yaml

import llmtune
from llmtune.features.base import Features
from tests.helpers import launch_cases, near, read_metrics, write_pairs

REFERENCES = [("model", "none"), ("adapter_off", "lora"), ("precomputed", "none")]
LAYOUTS = {"dp2": {"parallel.cp_size": 1}, "cp2": {"parallel.cp_size": 2}}
KTO = {"train.learning_rate": 5e-3}
BETA = 0.1  # dpo.beta and kto.beta, the default


def logps_scale(records: list[dict]) -> float:
    """The magnitude of the sequences' summed log-probabilities (|logps/*|, ~60 to ~130 here), which a reward, its
    margin and kto's kl (a mean log-ratio) are computed from: each layout rounds those sums at EPS32 x it."""
    return max(abs(r[key]) for r in records for key in ("logps/chosen", "logps/rejected") if key in r)


@pytest.fixture(scope="module")
def pairs_file(assets, tmp_path_factory):
    """32 of the demo's preference pairs, a third of them lengthened: packed rows hold 1, 2 or 3 pairs."""
    return write_pairs(assets, 32, tmp_path_factory.mktemp("pairs") / "pairs.jsonl")


@pytest.fixture(scope="module")
def examples_file(assets, tmp_path_factory):
    """KTO's examples from 16 of the demo's pairs: every chosen response desirable, one rejected in 4 too."""
    rows = [json.loads(line) for line in (assets / "data" / "dpo_train.jsonl").read_text().splitlines()[:16]]
    examples = [{"prompt": row["prompt"], "completion": row[key], "label": key == "chosen" or i % 4 != 0}
                for i, row in enumerate(rows) for key in ("chosen", "rejected")]
    path = tmp_path_factory.mktemp("examples") / "examples.jsonl"
    path.write_text("".join(json.dumps(example) + "\n" for example in examples))
    return path


def recipe(tiny_model, data_file) -> dict:
    return {"model": {"name_or_path": str(tiny_model)},
            "data": {"train_files": [str(data_file)], "chat_template": "basic", "max_seq_len": 128, "shuffle": False}}


def settings(output_dir, steps: int, **more) -> dict:
    return {"train.output_dir": str(output_dir), "train.max_steps": steps, "train.per_device_train_batch_size": 1,
            "train.global_batch_size": 4, "train.learning_rate": 2e-3, "train.logging_steps": 1,
            "checkpoint.export_hf": False, "monitor.plots": False, **more}


@pytest.fixture(scope="module")
def runs(tiny_model, pairs_file, examples_file, tmp_path_factory) -> dict[str, list[dict]]:
    """Every run's training records, by name: reference_MODE (cp=2, 1 step), dp2, cp2 and kto_cp2 (3 steps) on 2
    processes; one and kto_one, their 3 steps on 1 process."""
    root = tmp_path_factory.mktemp("dpo_ranks")
    recipes = {"dpo": recipe(tiny_model, pairs_file), "kto": recipe(tiny_model, examples_file)}
    for task, content in recipes.items():
        (root / f"{task}.yaml").write_text(yaml.safe_dump(content))
    # name: (task, overrides)
    two = {f"reference_{reference}": ("dpo", settings(root / f"reference_{reference}", 1, **{
               "parallel.cp_size": 2, "dpo.reference": reference, "peft.method": peft}))
           for reference, peft in REFERENCES}
    two |= {name: ("dpo", settings(root / name, 3, **layout)) for name, layout in LAYOUTS.items()}
    two["kto_cp2"] = ("kto", settings(root / "kto_cp2", 3, **{"parallel.cp_size": 2, **KTO}))
    launch_cases([{"recipe": str(root / f"{task}.yaml"), "task": task,
                   "overrides": [f"{key}={value}" for key, value in values.items()]}
                  for task, values in two.values()], root)
    llmtune.train("dpo", recipes["dpo"], **settings(root / "one", 3))
    llmtune.train("kto", recipes["kto"], **settings(root / "kto_one", 3, **KTO))
    # And with every sequence whole (no prompt computed once, data/collate.share_prefix): the 2-process runs share.
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(Features, "keep_shared_prefixes", lambda self: False)
        llmtune.train("dpo", recipes["dpo"], **settings(root / "one_whole", 3))
        llmtune.train("kto", recipes["kto"], **settings(root / "kto_one_whole", 3, **KTO))
    ones = ["one", "kto_one", "one_whole", "kto_one_whole"]
    return {name: [r for r in read_metrics(root / name) if "loss" in r] for name in [*two, *ones]}


@pytest.mark.parametrize("reference, peft", REFERENCES)
def test_every_reference_gives_no_reward_at_step_zero_under_context_parallelism(runs, reference, peft):
    first = runs[f"reference_{reference}"][0]
    assert abs(first["loss"] - math.log(2)) < 1e-6
    assert first["rewards/chosen"] == first["rewards/rejected"] == first["rewards/margins"] == 0.0
    assert first["rewards/accuracies"] == 0.5


@pytest.mark.parametrize("one_process", ["one", "one_whole"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_processes_give_the_losses_of_one(runs, layout, one_process):
    two, one = runs[layout], runs[one_process]
    assert len(one) == len(two) == 3
    for key in ("loss", "grad_norm", "logps/chosen"):
        assert [r[key] for r in two] == pytest.approx([r[key] for r in one], rel=1e-5, abs=1e-7), key
    # A margin, beta x a difference of log-ratios of sums ~100, can be near 0 (-0.012 at step 2) and keeps their
    # rounding: 9.5e-8 seen with AVX-512 kernels (beta x one ulp of one sequence's sum over the step's 4 pairs), 4.8e-7
    # with plain SSE ones, beyond 1e-7 absolute; near's 8 x EPS32 x beta x |logps| is ~1.2e-5, 25 times that and
    # 1/3000 of the margin's change from step 2 to step 3.
    margins = [r["rewards/margins"] for r in one]
    assert [r["rewards/margins"] for r in two] == near(margins, BETA * logps_scale(one)), "rewards/margins"


@pytest.mark.parametrize("one_process", ["kto_one", "kto_one_whole"])
def test_kto_on_two_context_parallel_processes_gives_the_losses_of_one(runs, one_process):
    two, one = runs["kto_cp2"], runs[one_process]
    assert one[0]["loss"] == pytest.approx(0.5, abs=1e-7) and one[-1]["kl"] > 0
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5, abs=1e-7), "loss"
    # kl, a mean log-ratio of sums ~60, is 0 at step 0 and can stay near it: absolute on the sums' scale (near's
    # 8 x EPS32 x |logps|, ~6e-5, against a kl that moves by more than 1 a step here).
    assert [r["kl"] for r in two] == near([r["kl"] for r in one], logps_scale(one)), "kl"
