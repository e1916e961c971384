"""Resume on another number of processes (fp32): a 1-process run killed (SIGKILL) at step 5 and resumed on 2 continues
the uninterrupted 2-process run's curve within 1e-5 and samples its completions; a recipe that sets the accumulation,
not the global batch, gets another global batch on another number of processes, and one line says so. The killed
2-process run's resumes are test_resume.py's (each file's launches under two minutes)."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.dist.test_resume import args, assert_continues, killed_run, logged_steps, resume, run_here, sampled


@pytest.fixture(scope="module")
def runs(straight_run, tiny_model, sft_file, tmp_path_factory):
    out = {"straight": straight_run[0], "resumed_on_2": tmp_path_factory.mktemp("one_proc")}
    killed_run(tiny_model, sft_file, out["resumed_on_2"], 1, lambda d: 5 in logged_steps(d))
    # A recipe that sets the accumulation, not the global batch: 4 x 1 rank x 4 = 16 samples a step, then 32 on 2.
    accumulated = tmp_path_factory.mktemp("accumulated")
    no_global = ("train.global_batch_size=null", "train.gradient_accumulation_steps=4")
    with ThreadPoolExecutor(1) as pool:
        resumed = pool.submit(resume, tiny_model, sft_file, out["resumed_on_2"], 2)
        run_here(*args(tiny_model, sft_file, accumulated, 1, *no_global, "train.max_steps=2"))
        out["log_accumulated_on_2"] = resume(tiny_model, sft_file, accumulated, 2, *no_global, "train.max_steps=3")
        out["log_resumed_on_2"] = resumed.result()
    return out


def test_a_1_process_run_resumed_on_2_continues_the_curve_and_samples_its_completions(runs):
    assert_continues(runs["resumed_on_2"], runs["straight"])
    assert sampled(runs["resumed_on_2"]) == sampled(runs["straight"])


def test_a_resume_on_another_process_count_says_when_the_global_batch_changes(runs):
    """The recipe's global batch is kept (train.global_batch_size): nothing to say. A recipe that sets the
    accumulation gets another global batch on another number of processes: one line says so, and how to keep it."""
    assert "global batch changes" not in runs["log_resumed_on_2"]
    said = [line for line in runs["log_accumulated_on_2"].splitlines() if "global batch changes" in line]
    assert len(said) == 1 and said[0].endswith(
        "checkpoint: the global batch changes from 16 samples per optimizer step (the checkpoint's, on 1 ranks) to 32 "
        "on 2 ranks; set train.global_batch_size: 16 to keep it"), runs["log_accumulated_on_2"][-3000:]
