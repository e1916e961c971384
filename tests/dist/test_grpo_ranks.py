"""llmtune grpo over layouts: for every loss_type, for GSPO's sequence-level ratio with a KL term against a reference
copy, and for rounds of completions trained over 2 steps twice (ratios against the old policy, clipped), 1 process
accumulating 4 micro-batches, 1 process with the step in one micro-batch, 2 data-parallel processes accumulating 2
and 2 context-parallel peers, each computing a prompt once for its completions in a micro-batch, and 1 process with
every completion after its prompt in full give the same per-step losses and gradient norms (1e-5 relative) and
sample the same completions, token for token (the later rounds' from the weights the earlier steps trained); and a
2-process run killed inside a round resumes bitwise: the same losses, completions and final weights. Every 2-process
run but the killed one trains in one launch; the 1-process runs in pytest's own process."""

import json
import shutil
import signal

import pytest
import torch
import yaml
from safetensors.torch import load_file

import llmtune
from llmtune.features.base import Features
from tests.dist.test_resume import logged_steps, signal_tree, wait_for
from tests.helpers import kill_tree, launch_cases, near, read_metrics, run_cli, start_cli

STEPS = 4
VARIANTS = {
    "grpo": {"grpo.loss_type": "grpo"},
    "bnpo": {"grpo.loss_type": "bnpo"},
    "dr_grpo": {"grpo.loss_type": "dr_grpo"},
    "dapo": {},
    "gspo_kl": {"grpo.importance_sampling_level": "sequence", "grpo.beta": 0.1, "grpo.loss_type": "grpo"},
    # A round of 16 completions trained over 2 steps, twice: ratios against the old policy's log-probabilities.
    "rounds": {"grpo.generation_batch_size": 16, "grpo.num_iterations": 2, "grpo.epsilon_high": 0.28,
               "grpo.beta": 0.1},
}
# The killed run: rounds over 2 steps, a checkpoint at every step; killed once step 3's is written, it resumes inside
# the round of steps 3 and 4, then samples the rounds of steps 5 and 6 itself.
KILLED = {"train.max_steps": 6, "checkpoint.save_steps": 1, "grpo.generation_batch_size": 16,
          "train.gradient_accumulation_steps": 2}
LAYOUTS = {"dp2": {"train.gradient_accumulation_steps": 2}, "cp2": {"parallel.cp_size": 2}}
# On one process: the step's 8 completions in one micro-batch (a normalizer per micro-batch would differ here).
WHOLE = {"train.per_device_train_batch_size": 8, "train.gradient_accumulation_steps": 1}
# The magnitude of the terms the metrics near 0 are sums of. The loss: each token's -ratio x advantage, the advantages
# of a group of 4 within (4 - 1) / sqrt(4) = 1.5 of 0 and the ratios near 1; at ratio 1 those cancel to 0 up to their
# rounding (1.1e-8 seen, in every layout, with AVX-512 and with plain SSE kernels alike). kl: each token's k3,
# exp(d) - d - 1, rounded at fp32's epsilon x 1.
NEAR_ZERO_SCALES = {"loss": 2.0, "kl": 1.0}


def settings(output_dir, **more) -> dict:
    """Rounds of 2 prompts x 4 completions, micro-batches of 2 completions; rewards that differ within groups of the
    random model's completions (a digit anywhere, the answer's number); a learning rate that moves the samples."""
    return {"train.output_dir": str(output_dir), "train.max_steps": STEPS, "train.per_device_train_batch_size": 2,
            "train.gradient_accumulation_steps": 4, "train.learning_rate": 5e-2, "train.logging_steps": 1,
            "checkpoint.save_steps": 2, "checkpoint.export_dtype": "fp32", "monitor.plots": False,
            "grpo.reward_funcs": ["regex_match", "numeric_match"], "grpo.regex": r".*\d", "grpo.num_generations": 4,
            "grpo.max_completion_length": 6, **more}


@pytest.fixture(scope="module")
def runs(tiny_model, grpo_prompts_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_ranks")
    recipe = root / "grpo.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"name_or_path": str(tiny_model)},
                                      "data": {"train_files": [str(grpo_prompts_file)], "chat_template": "basic",
                                               "max_seq_len": 64}}))
    two = {f"{variant}_{layout}": settings(root / f"{variant}_{layout}", **values, **changes)
           for variant, values in VARIANTS.items() for layout, changes in LAYOUTS.items()}
    two["straight"] = settings(root / "straight", **KILLED)
    launch_cases([{"recipe": str(recipe), "task": "grpo", "overrides": [f"{k}={v}" for k, v in values.items()]}
                  for values in two.values()], root)
    for variant, values in VARIANTS.items():
        llmtune.train("grpo", str(recipe), **settings(root / f"{variant}_one", **values))
        llmtune.train("grpo", str(recipe), **settings(root / f"{variant}_whole", **values, **WHOLE))
        # Every completion after its prompt in full, none a branch of another (the features' vote off).
        with pytest.MonkeyPatch.context() as patched:
            patched.setattr(Features, "keep_shared_prefixes", lambda self: False)
            llmtune.train("grpo", str(recipe), **settings(root / f"{variant}_unshared", **values))

    # Stopped once step 3's checkpoint is written, its folder copied (what a SIGKILL leaves then), then killed.
    killed, resumed = root / "killed", root / "resumed"
    words = ["grpo", str(recipe), *(f"{k}={v}" for k, v in settings(killed, **KILLED).items()), "--nproc", "2"]
    process = start_cli(*words)
    latest = killed / "checkpoints" / "latest"
    wait_for(lambda: latest.is_file() and latest.read_text() == "global_step_3", process)
    signal_tree(process, signal.SIGSTOP)
    shutil.copytree(killed, resumed)
    kill_tree(process)
    result = run_cli(*[word.replace(str(killed), str(resumed)) for word in words],
                     "--resume_from_checkpoint", "latest")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming after step 3" in result.stderr
    return root


def records(folder) -> list[dict]:
    return [r for r in read_metrics(folder) if "loss" in r]


def completions(folder) -> list[tuple[int, list[int]]]:
    return [(row["step"], row["completion_ids"]) for row in
            map(json.loads, (folder / "completions.jsonl").read_text().splitlines())]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layout", [*LAYOUTS, "whole", "unshared"])
def test_every_layout_gives_the_losses_gradients_and_completions_of_one_process(runs, variant, layout):
    one, other = records(runs / f"{variant}_one"), records(runs / f"{variant}_{layout}")
    assert [r["step"] for r in other] == [r["step"] for r in one] == list(range(1, STEPS + 1))
    for key in ("grad_norm", "reward", "entropy"):
        assert [r[key] for r in other] == pytest.approx([r[key] for r in one], rel=1e-5, abs=1e-7), key
    for key in ("loss", *(["kl"] if "kl" in variant else [])):
        # At ratio 1 a group's token terms cancel: grpo's loss is 0 up to their rounding, and a kl starts at 0. Absolute
        # near's 8 x EPS32 x NEAR_ZERO_SCALES (1.9e-6 on the loss, 170 times the difference seen; 1/1000 of gspo_kl's
        # loss at step 2, 2.6e-3).
        assert [r[key] for r in other] == near([r[key] for r in one], NEAR_ZERO_SCALES[key]), key
    assert any(r["grad_norm"] > 0 for r in one), "the rewards must differ within a group, or nothing trains"
    assert completions(runs / f"{variant}_{layout}") == completions(runs / f"{variant}_one")
    sampled = completions(runs / f"{variant}_one")
    rounds = range(1, STEPS + 1, 4 if variant == "rounds" else 1)  # a round's completions are logged as it begins
    assert [step for step, _ in sampled] == [step for step in rounds for _ in range(len(sampled) // len(rounds))]
    assert sampled[:8] != sampled[-8:], "the rounds sample different prompts"
    if variant == "rounds":
        assert any(r["clip_ratio/region_mean"] > 0 for r in one), "the later steps' ratios must leave the clip range"


def test_a_killed_run_resumes_bitwise_completions_included(runs):
    straight, resumed = runs / "straight", runs / "resumed"
    assert [r["step"] for r in records(resumed)] == list(range(1, 7))
    assert [(r["loss"], r["grad_norm"], r["reward"]) for r in records(resumed)] == \
        [(r["loss"], r["grad_norm"], r["reward"]) for r in records(straight)]
    assert completions(resumed) == completions(straight)
    assert [step for step, _ in completions(resumed)] == [1] * 16 + [3] * 16 + [5] * 16
    reference = load_file(straight / "hf" / "model.safetensors")
    weights = load_file(resumed / "hf" / "model.safetensors")
    assert weights.keys() == reference.keys() and all(torch.equal(reference[k], weights[k]) for k in reference)
