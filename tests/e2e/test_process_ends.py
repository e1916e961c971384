"""How a command ends when its user ends it: Ctrl-C before training exits 130 with one line and leaves nothing
half-written; Ctrl-C during a demo stage saves, exits 75, and the demo run again goes on from there; a reader of
stdout that goes away (`| head`) ends it quietly."""

import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from llmtune.demo import run as demo_run
from llmtune.run.cli import main as cli_main
from tests.helpers import REPO, read_metrics


@pytest.fixture
def recipe(tmp_path, tiny_model, sft_file) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(tiny_model)},
        "data": {"train_files": [str(sft_file)], "chat_template": "basic", "max_seq_len": 64},
        "train": {"output_dir": str(tmp_path / "out"), "max_steps": 2, "per_device_train_batch_size": 2},
        "monitor": {"plots": False},  # no test here reads them
    }))
    return str(path)


def test_ctrl_c_while_the_data_cache_is_written_exits_130_and_leaves_no_partial_entry(
        tmp_path, recipe, monkeypatch, capsys):
    cache = tmp_path / "cache"
    monkeypatch.setenv("LLMTUNE_CACHE", str(cache))
    import datasets

    save = datasets.Dataset.save_to_disk

    def interrupted(self, path, *args, **kwargs):
        save(self, path, *args, **kwargs)  # one split written whole, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", interrupted)
    assert cli_main(["sft", recipe]) == 130
    err = capsys.readouterr().err  # datasets' progress bars, then llmtune's line
    assert err.strip().splitlines()[-1] == "llmtune: interrupted (Ctrl-C)" and "Traceback" not in err
    assert not list((cache / "data").iterdir()), "no entry, whole or partial, is left in the cache"
    assert not (tmp_path / "out" / "checkpoints").exists()
    monkeypatch.setattr(datasets.Dataset, "save_to_disk", save)
    assert cli_main(["sft", recipe, "--overwrite_output_dir", "true"]) == 0, "the next run builds the entry afresh"


def importing_torch(pid: int) -> bool:
    """Whether process `pid` (bin/llmtune, exec'd into python) has got as far as loading torch's library: llmtune's
    command is running, its SIGINT handler set long before, and training is seconds away. Read from /proc."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.slow
def test_ctrl_c_before_the_first_step_exits_130_without_a_traceback(tmp_path, recipe):
    # SIGINT's default action in the child whatever this process's is: a suite started in the background by a
    # shell without job control ignores SIGINT, a setting its children inherit and Python then keeps.
    process = subprocess.Popen([str(REPO / "bin" / "llmtune"), "sft", recipe], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not importing_torch(process.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == "llmtune: interrupted (Ctrl-C)" and "Traceback" not in err, err
    assert not (tmp_path / "out" / "checkpoints").exists() and not (tmp_path / "out" / "hf").exists()


# One stage of `llmtune demo` as the demo runs it (demo/run.run_stage: the stage's own process, which the demo waits
# for), with runs/demo under the folder argv[1], ended as `llmtune` ends.
DEMO_STAGE = ("import sys; from pathlib import Path; from llmtune.demo.run import run_stage; "
              "from llmtune.run.process_exit import run_and_exit; "
              "run_and_exit(lambda: run_stage('pt', sys.argv[2:], None, Path(sys.argv[1])))")


@pytest.mark.slow
def test_ctrl_c_during_a_demo_stage_saves_exits_75_and_the_demo_goes_on_from_it(tmp_path, assets, monkeypatch,
                                                                                capsys):
    """SIGINT to the demo's process group after the first logged step, as a terminal sends Ctrl-C to the demo and its
    stage alike: the demo waits while the stage saves, and both exit 75. Run again, the stage goes on from that
    checkpoint; once more, finished, it trains no more. The runs again are about how the demo starts its stage, not
    about a process: their stage runs in pytest's process (the CLI's main on the demo's command line)."""
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    (tmp_path / "runs" / "demo" / "assets").symlink_to(assets)
    out = tmp_path / "runs" / "demo" / "pt"
    small = ["train.global_batch_size=2", "train.per_device_train_batch_size=2", "train.logging_steps=1",
             "data.max_seq_len=64", "monitor.plots=false"]
    # SIGINT's default action in the demo whatever this process's is (see the test above); a session of its own, so
    # that the signal to its group reaches the demo and its stage, not the tests.
    with open(tmp_path / "demo.log", "w") as log:
        demo = subprocess.Popen([sys.executable, "-c", DEMO_STAGE, str(tmp_path), *small, "train.max_steps=1000"],
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 300
    while not (out / "metrics.jsonl").is_file() and demo.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert demo.poll() is None, (tmp_path / "demo.log").read_text()[-3000:]
    os.killpg(demo.pid, signal.SIGINT)
    assert demo.wait(timeout=300) == 75, (tmp_path / "demo.log").read_text()[-3000:]
    log = (tmp_path / "demo.log").read_text()
    assert "SIGINT received: saving a checkpoint" in log and "llmtune: stopped by SIGINT after step" in log
    stopped = int((out / "checkpoints" / "latest").read_text().removeprefix("global_step_"))
    assert stopped >= 1 and not (out / "hf").exists()
    before = read_metrics(out)[:stopped]

    def stage_here(command: list[str], cwd: Path) -> int:
        assert command[:3] == [sys.executable, "-m", "llmtune"], command
        monkeypatch.chdir(cwd)  # the demo's recipe names its files from the folder that holds runs/demo
        return cli_main(command[3:])

    monkeypatch.setattr(demo_run, "wait_for", stage_here)
    capsys.readouterr()
    assert demo_run.run_stage("pt", [*small, f"train.max_steps={stopped + 2}"], None, tmp_path) == 0
    assert "checkpoint.resume_from_checkpoint=auto" in capsys.readouterr().out
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, stopped + 3))
    assert records[:stopped] == before, "it went on from the checkpoint: the steps before it were not trained again"
    assert (out / "hf" / "model.safetensors").is_file()

    finished = (out / "metrics.jsonl").read_text()
    assert demo_run.run_stage("pt", [*small, f"train.max_steps={stopped + 2}"], None, tmp_path) == 0
    assert (out / "metrics.jsonl").read_text() == finished, "a finished stage trains no more"


@pytest.mark.parametrize("command", [["sft", "--help"],
                                     pytest.param(["data", "RECIPE", "--n", "50"], marks=pytest.mark.slow)])
def test_a_reader_that_goes_away_ends_the_command_quietly(recipe, command):
    """The read end is closed before the command writes a byte: its first write meets a closed pipe, as when
    `llmtune sft --help | head -1` has read its line."""
    args = [recipe if word == "RECIPE" else word for word in command]
    read, write = os.pipe()
    os.close(read)
    process = subprocess.Popen([str(REPO / "bin" / "llmtune"), *args], cwd=REPO, stdout=write,
                               stderr=subprocess.PIPE, text=True)
    os.close(write)
    _, err = process.communicate(timeout=300)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert process.returncode == 128 + signal.SIGPIPE, err


def test_the_summary_of_a_stop_between_two_records_names_the_step_it_stopped_at(tmp_path, recipe, monkeypatch,
                                                                                    capsys, caplog):
    """A stop by a signal after step 3, records every 5 steps: the last line and the summary both say step 3."""
    from llmtune.training.stop_signals import StopSignals

    asked = []

    def number(self):
        asked.append(1)
        return signal.SIGTERM.value if len(asked) == 3 else 0

    monkeypatch.setattr(StopSignals, "number", property(number))
    caplog.set_level(logging.INFO, logger="llmtune")
    assert cli_main(["sft", recipe, "--max_steps", "10", "--logging_steps", "5"]) == 75
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("llmtune: stopped by SIGTERM after step 3 of 10")
    summary = caplog.records[-1].getMessage()
    assert summary.startswith("run stopped by a signal at step 3 of 10"), summary


@pytest.mark.slow
def test_the_printed_resume_and_export_commands_run_as_printed(tmp_path, recipe, monkeypatch, capsys, caplog):
    """A run of a recipe that sets train.overwrite_output_dir: true (as every LLaMA-Factory example does), stopped by
    a signal after step 2 of 4: the command its last line prints goes on from step 2 to the end, and the summary's
    export command writes a HF folder. Both run as printed, from where the run was started, through bin/llmtune
    (which names itself in the commands it prints)."""
    from llmtune.training.stop_signals import StopSignals

    given = yaml.safe_load(Path(recipe).read_text())
    given["train"].update(overwrite_output_dir=True, logging_steps=1)
    Path(recipe).write_text(yaml.safe_dump(given))
    asked = []

    def number(self):
        asked.append(1)
        return signal.SIGTERM.value if len(asked) == 2 else 0

    monkeypatch.setattr(StopSignals, "number", property(number))
    monkeypatch.setenv("LLMTUNE_PROG", str(REPO / "bin" / "llmtune"))
    caplog.set_level(logging.INFO, logger="llmtune")
    assert cli_main(["sft", recipe, "--max_steps", "4", "train.overwrite_output_dir=true"]) == 75
    resume = capsys.readouterr().err.strip().splitlines()[-1].partition("; resume with: ")[2]
    summary = caplog.records[-1].getMessage()
    assert f"go on from it with: {resume})" in summary
    export = summary.partition("export it with: ")[2].partition(";")[0]
    assert export.startswith(f"{REPO / 'bin' / 'llmtune'} export ") and export.endswith(" OUT_DIR"), summary

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LLMTUNE_PROG")}
    for command in (resume, export):
        done = subprocess.run(shlex.split(command), cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, (command, done.stderr[-3000:])
    assert [r["step"] for r in read_metrics(tmp_path / "out") if "loss" in r] == [1, 2, 3, 4]
    assert (tmp_path / "out" / "hf" / "model.safetensors").is_file()
    assert (tmp_path / "OUT_DIR" / "config.json").is_file()
