"""Resume after SIGKILL (2 processes, fp32): the resumed run's losses and final weights are bitwise those of
an uninterrupted run, also when the kill lands while a checkpoint is being written; and a 2-process run resumes on 1
process on the same curve within 1e-5 (1 -> 2, and the global batch a resume changes: test_resume_world_size.py).
Every resume lands in epoch 1 (an epoch is 4 steps here). The uninterrupted run also carries the 2-process checks of
the start banner and of monitor.profile_ranks."""

import contextlib
import json
import os
import re
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from llmtune.run.cli import main as cli_main
from tests.helpers import cli_words, descendants, kill_tree, read_metrics, run_cli, start_cli

STEPS = 8
# Completions sampled from the first training prompts (strings, TRL's text form) every 2 steps.
SAMPLED_EVALUATION = ("eval_generation.max_samples=3", "eval_generation.steps=2", "eval_generation.do_sample=true",
                      "eval_generation.temperature=1.5", "eval_generation.num_return_sequences=2",
                      "eval_generation.max_new_tokens=6", "eval_generation.answer_column=response")


def args(tiny_model, sft_file, output_dir, nproc, *extra):
    return ["sft", "recipes/demo/sft.yaml", f"model.name_or_path={tiny_model}", f"data.train_files={sft_file}",
            f"eval_generation.files={sft_file}",
            "data.packing=false", f"train.output_dir={output_dir}", f"train.max_steps={STEPS}", "train.logging_steps=1",
            "train.per_device_train_batch_size=4", "train.global_batch_size=16", "train.learning_rate=2e-3",
            "checkpoint.save_steps=2", "checkpoint.export_dtype=fp32", *SAMPLED_EVALUATION, "--nproc", str(nproc),
            *extra]


def wait_for(condition, process, timeout=300.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, "the run ended before the kill"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def killed_run(tiny_model, sft_file, output_dir, nproc, condition):
    process = start_cli(*args(tiny_model, sft_file, output_dir, nproc))
    wait_for(lambda: condition(output_dir), process)
    kill_tree(process)


def signal_tree(process, sig) -> None:
    """sig to a run's launcher and every process below it."""
    for pid in [process.pid, *descendants(process.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def resume(tiny_model, sft_file, output_dir, nproc, *extra) -> str:
    """The resumed run's log."""
    result = run_cli(*args(tiny_model, sft_file, output_dir, nproc, "--resume_from_checkpoint", "latest", *extra))
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


def run_here(*argv: str) -> None:
    """A run on one process in pytest's own, through the CLI's code: a process of its own would first spend ~6 s
    importing torch. For runs that no test kills or reads the log of."""
    assert cli_main(cli_words(argv)) == 0


def logged_steps(output_dir):
    path = output_dir / "metrics.jsonl"
    return [m["step"] for m in read_metrics(output_dir)] if path.is_file() else []


@pytest.fixture(scope="module")
def runs(straight_run, tiny_model, sft_file, tmp_path_factory):
    out = {"straight": straight_run[0]}

    # One 2-process run makes both kills (a launch costs ~10 s). Once step 5 is logged, its processes are stopped
    # (SIGSTOP) and its folder copied: the files a SIGKILL would leave then, since a stopped process writes nothing
    # more and a killed one's written data stays. Let go on, it is killed while global_step_6 is written.
    killed = tmp_path_factory.mktemp("killed")
    process = start_cli(*args(tiny_model, sft_file, killed, 2))
    wait_for(lambda: 5 in logged_steps(killed), process)
    signal_tree(process, signal.SIGSTOP)
    for name in ("resumed", "resumed_on_1"):
        out[name] = tmp_path_factory.mktemp(name) / "run"
        shutil.copytree(killed, out[name])
    signal_tree(process, signal.SIGCONT)
    wait_for(lambda: (killed / "checkpoints" / ".global_step_6.partial").exists(), process)
    kill_tree(process)
    out["latest_at_kill"] = (out["resumed"] / "checkpoints" / "latest").read_text()
    out["partial_left"] = (killed / "checkpoints" / ".global_step_6.partial").exists()
    out["latest_mid_save"] = (killed / "checkpoints" / "latest").read_text()
    out["resumed_mid_save"] = killed

    # The resumes on 2 processes, two launches at a time (one alone leaves a core idle while its launcher imports
    # torch), and the one on 1 in this process meanwhile.
    with ThreadPoolExecutor(2) as pool:
        logs = [pool.submit(resume, tiny_model, sft_file, out[name], 2) for name in ("resumed", "resumed_mid_save")]
        run_here(*args(tiny_model, sft_file, out["resumed_on_1"], 1, "--resume_from_checkpoint", "latest"))
        [log.result() for log in logs]
    return out


def losses(output_dir):
    return [m["loss"] for m in read_metrics(output_dir)]


def weights(output_dir):
    return load_file(output_dir / "hf" / "model.safetensors")


def test_killed_run_resumes_bitwise(runs):
    assert runs["latest_at_kill"] == "global_step_4"
    assert [m["step"] for m in read_metrics(runs["resumed"])] == list(range(1, STEPS + 1))
    assert losses(runs["resumed"]) == losses(runs["straight"])
    reference = weights(runs["straight"])
    assert all(torch.equal(reference[k], v) for k, v in weights(runs["resumed"]).items())


def sampled(output_dir) -> list[tuple[int, list[int]]]:
    return [(row["step"], row["completion_ids"]) for row in map(json.loads,
                                                                (output_dir / "generations.jsonl").read_text().splitlines())]


def test_a_resumed_run_samples_the_same_completions_on_any_number_of_processes(runs):
    """Each completion is drawn by a generator of its own (seed, step, prompt, sample): the straight run's, a run
    killed and resumed on 2 processes, or on 1 (whose weights differ from the 2-process run's by fp32 rounding, 1e-5
    at most: far from moving a draw across the edge between two tokens, which it would need to land within that
    much of)."""
    straight = sampled(runs["straight"])
    assert [step for step, _ in straight] == [step for step in (2, 4, 6, 8) for _ in range(6)]
    assert len({tuple(ids) for _, ids in straight}) > 6
    for name in ("resumed", "resumed_mid_save", "resumed_on_1"):
        assert sampled(runs[name]) == straight, name


def test_kill_while_a_checkpoint_is_written_resumes_from_the_previous_one(runs):
    assert runs["partial_left"], "the kill landed while global_step_6 was being written"
    assert runs["latest_mid_save"] == "global_step_4"
    assert losses(runs["resumed_mid_save"]) == losses(runs["straight"])
    reference = weights(runs["straight"])
    assert all(torch.equal(reference[k], v) for k, v in weights(runs["resumed_mid_save"]).items())
    assert not (runs["resumed_mid_save"] / "checkpoints" / ".global_step_6.partial").exists()


def test_resume_on_another_world_size_continues_the_curve(runs):
    assert_continues(runs["resumed_on_1"], runs["straight"])


def assert_continues(output_dir, straight):
    """The run resumed on another number of processes is the straight run's to fp32 rounding."""
    assert losses(output_dir) == pytest.approx(losses(straight), rel=1e-5)
    reference = weights(straight)
    for key, value in weights(output_dir).items():
        torch.testing.assert_close(value, reference[key], rtol=0, atol=1e-5)


def test_the_straight_run_traces_its_chosen_rank_alone_and_its_banner_counts_the_whole_model(straight_run,
                                                                                             tiny_model):
    output_dir, result = straight_run
    (trace,) = (output_dir / "profile").iterdir()
    assert trace.name.startswith("rank1."), "monitor.profile_ranks: [1]"
    assert '"Input Dims"' in trace.read_text(), "monitor.record_shapes: true"
    # Rank 0 alone says the banner; its parameters are the whole model's, not a rank's shard of it.
    banner = re.findall(r"INFO llmtune: start: (.*)", result.stderr)
    assert banner.count(f"64 samples, 2 epochs of 4 steps = {STEPS} optimizer steps") == 1, banner
    assert "global batch 16 samples = micro-batch 4 x accumulation 2 x 2 data-parallel" in banner
    assert "layout 2 rank(s) = replicate 1 x shard 2 x cp 1; every parameter sharded over 2 rank(s)" in banner
    count = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model).parameters())
    assert any(line.startswith(f"parameters {count:,}, trainable {count:,} ") for line in banner), banner
    logged = (output_dir / "train.log").read_text()
    assert all(f"start: {line}" in logged for line in banner)
