"""Bad input: one line naming the key or path, exit code 2, before torch is even imported (so before any
process group exists), and nothing written.

Most refusals go through the CLI's main in pytest's process (in_process), which spares each a process's start-up
(seconds, for a refusal made against the model). What bin/llmtune adds, the process's end (the exit code, nothing on
stderr but the message: no traceback, no library's warning), is checked through it once per kind of refusal: found
before torch is imported (test_missing_recipe_file), against the model, by the worker of a one-process run and under
torchrun (the launches fixture's, side by side)."""

import functools
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import yaml

from llmtune.run.cli import main as cli_main
from tests.helpers import REPO, free_port, run_cli


def write_recipe(folder, tiny_model, sft_file, **changes) -> str:
    """folder/recipe.yaml, a one-step sft run writing to folder/out; changes: section__key=value."""
    recipe = {"model": {"name_or_path": str(tiny_model)},
              "data": {"train_files": [str(sft_file)], "chat_template": "basic"},
              "train": {"output_dir": str(folder / "out"), "max_steps": 1}}
    for key, value in changes.items():
        section, name = key.split("__")
        recipe.setdefault(section, {})[name] = value
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


@pytest.fixture
def recipe(tmp_path, tiny_model, sft_file):
    return functools.partial(write_recipe, tmp_path, tiny_model, sft_file)


def in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """`llmtune ARGS` through the CLI's main in this process: its exit code and what it printed. A refusal made by
    a launched process instead of this one would not be read here."""
    capsys.readouterr()  # what came before: not the CLI's
    code = cli_main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


@pytest.mark.parametrize("changes, overrides, expected", [
    ({"train__learnig_rate": 1e-4}, [],
     "train.learnig_rate: unknown key in section 'train'; did you mean 'train.learning_rate'?"),
    ({}, ["train.per_device_train_batch_size=two"],
     "train.per_device_train_batch_size: 'two' is neither a number of samples nor auto"),
    ({"data__train_files": ["no/such/file.jsonl"]}, [], "data.train_files: 'no/such/file.jsonl' matches no data file"),
    ({"model__name_or_path": "no/such/model"}, [], "model.name_or_path: no/such/model is not a HF model folder"),
    ({}, ["--nproc", "0"], "--nproc: '0' is not a positive number of processes"),
    ({"data__chat_template": None}, [], "data.chat_template: the tokenizer in "),
    ({}, ["--resume_from_checkpoint", "no/such/global_step_5"],
     "checkpoint.resume_from_checkpoint: no/such/global_step_5 is not a checkpoint folder"),
    ({"peft__method": "lora", "peft__r": 0}, [], "peft.r: 0 must be a positive rank (at least 1)"),
    ({"peft__method": "lora", "peft__modules_to_save": ["embeddings"]}, [],
     "peft.modules_to_save: embeddings match no module of the model"),
    ({"peft__method": "lora", "peft__adapter_path": "no/such/adapter"}, [],
     "peft.adapter_path: no/such/adapter lacks adapter_config.json and adapter_model.safetensors"),
    ({"train__frozen_modules": [r"layers\.9\."]}, [], r"train.frozen_modules: 'layers\\.9\\.' matches no parameter"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, recipe, capsys, changes, overrides, expected):
    result = in_process(capsys, "sft", recipe(**changes), *overrides, "--nproc", "2")
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"llmtune: error: {expected}"), result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusals of CUDA-only backends need a machine without CUDA")
@pytest.mark.parametrize("backend, expected", [
    ("flash", "model.attn_implementation: 'flash' is not an attention backend; use one of auto, sdpa, eager, "
              "varlen, flash_attention_2, flash_attention_3, flex_attention or a Hub kernel"),
    ("varlen", "model.attn_implementation: varlen needs a CUDA device and this machine has none; use auto (sdpa "
               "here) or sdpa"),
    ("flash_attention_2", "model.attn_implementation: flash_attention_2 needs a CUDA device and this machine has "
                          "none; use auto (sdpa here) or sdpa"),
    ("kernels-community/flash-attn2", "model.attn_implementation: kernels-community/flash-attn2 needs a CUDA device"),
    ("flex_attention", "model.attn_implementation: flex_attention cannot train on CPU"),
])
def test_an_attention_backend_this_machine_cannot_train_with_is_refused_up_front(tmp_path, recipe, capsys, backend,
                                                                               expected):
    result = in_process(capsys, "sft", recipe(model__attn_implementation=backend), "--nproc", "2")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"llmtune: error: {expected}"), result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("task, name, content, problem", [
    ("sft", "empty.jsonl", "", "is empty"),
    ("sft", "blank.jsonl", "\n  \n\n", "holds only blank lines"),
    ("sft", "empty.csv", "", "is empty"),
    ("sft", "header.csv", "prompt,response\n", "has a header line but no rows"),
    ("pt", "empty.txt", "", "is empty"),
    ("pt", "blank.txt", "\n\n \n", "holds only blank lines"),
])
def test_a_data_file_without_rows_is_named_before_any_process_starts(tmp_path, recipe, capsys, task, name, content,
                                                                     problem):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "good.jsonl").write_text('{"prompt": "1 + 1?", "response": "2", "text": "1 + 1 = 2"}\n')
    empty = tmp_path / "data" / name
    empty.write_text(content)
    result = in_process(capsys, task, recipe(data__train_files=[str(tmp_path / "data")]), "--nproc", "2")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        f"llmtune: error: data.train_files: {empty} {problem}; add rows to it or take it out of data.train_files"]
    assert not (tmp_path / "out").exists()


def test_a_refusal_the_worker_finds_leaves_no_output_folder(tmp_path, recipe, capsys):
    """A row that is not JSON is found once the worker builds the data, after rank 0 started the output folder
    (train.log): a refused run writes nothing, so the folder it made goes with it."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1 + 1?", "response": "2"}\n{"prompt": "2 + 2?", "response": 4\n')
    result = in_process(capsys, "sft", recipe(data__train_files=[str(bad)]))
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"llmtune: error: {bad}:2: not valid JSON (Expecting ',' delimiter); write one JSON object per line")
    assert not (tmp_path / "out").exists()


def test_missing_recipe_file():
    result = run_cli("pt", "no_such_recipe.yaml")
    assert result.returncode == 2
    assert result.stderr.strip() == ("llmtune: error: no_such_recipe.yaml: recipe file not found; "
                                     "pass the path of a YAML recipe")


def test_plan_of_a_hub_id_the_hub_cannot_give_fails_at_once_naming_the_cache(tmp_path):
    """Without network (the Hub's address a closed local port) and without the config in the cache, transformers'
    download of the config retried the Hub for a minute (its warnings on stderr) before failing; llmtune's fetch asks
    once."""
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"model": {"name_or_path": "org/uncached"}, "data": {"train_files": ["t.jsonl"]},
                                    "train": {"output_dir": str(tmp_path / "out")}}))
    cache = tmp_path / "hf" / "hub"
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": None,
           "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    started = time.monotonic()
    result = run_cli("plan", str(path), env=env, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"llmtune: error: model.name_or_path: org/uncached (revision main) is neither a local path nor in the Hub "
        f"cache {cache}, and the Hub cannot be reached; fetch it once with network access (HF_HUB_OFFLINE=1 then reads "
        "it from the cache, asking the Hub nothing), name a local path instead, or correct the name")
    assert time.monotonic() - started < 60, "no retries"


def test_recipe_errors_are_found_before_torch_is_imported(tmp_path, recipe):
    """No process group can exist yet: torch itself has not been imported when the error is raised."""
    code = ("import sys; from llmtune.run.cli import main; "
            f"assert main(['sft', {recipe(train__max_stepz=3)!r}]) == 2; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "train.max_stepz: unknown key" in result.stderr


# A folder of data.dataset_info: its entry `calls`, a conversation whose tool result follows no tool call.
TOOL_CALLS = {
    "dataset_info.json": '{"calls": {"file_name": "calls.json", "formatting": "sharegpt"}}',
    "calls.json": '[{"conversations": [{"from": "human", "value": "Hi"}, {"from": "observation", "value": "5"}, '
                  '{"from": "gpt", "value": "Ok"}]}]'}


@pytest.fixture(scope="module")
def launches(tmp_path_factory, tiny_model, sft_file) -> dict:
    """name: (its folder, bin/llmtune's result) of the refusals checked through bin/llmtune, launched side by side:
    most of a launch is its processes' start-up (importing torch, transformers, datasets), one core's work.
    model: peft.target_modules matching no layer, refused against the model (torch, transformers and peft imported,
    the model built on the meta device); worker: a data.dataset_info entry whose conversation has a tool result
    without a call, found by the worker of a one-process run; on 2 processes, bad_row: a data file whose second row
    is not JSON; incomplete: resuming from a checkpoint folder that holds only config.yaml."""
    folders = {name: tmp_path_factory.mktemp(name) for name in ("model", "worker", "bad_row", "incomplete")}
    for name, text in TOOL_CALLS.items():
        (folders["worker"] / name).write_text(text)
    bad = folders["bad_row"] / "bad.jsonl"
    bad.write_text('{"prompt": "1 + 1?", "response": "2"}\n{"prompt": "2 + 2?", "response": 4\n')
    checkpoint = folders["incomplete"] / "global_step_3"
    checkpoint.mkdir()
    (checkpoint / "config.yaml").write_text("{}\n")
    commands = {
        "model": ["sft", write_recipe(folders["model"], tiny_model, sft_file, peft__method="lora",
                                      peft__target_modules=["qkv_proj"]), "--nproc", "2"],
        "worker": ["sft", write_recipe(folders["worker"], tiny_model, sft_file, data__train_files=[],
                                       data__dataset_info=str(folders["worker"]), data__datasets=["calls"])],
        "bad_row": ["sft", write_recipe(folders["bad_row"], tiny_model, sft_file, data__train_files=[str(bad)]),
                    "--nproc", "2"],
        "incomplete": ["sft", write_recipe(folders["incomplete"], tiny_model, sft_file), "data.packing=false",
                       "train.per_device_train_batch_size=2", "--resume_from_checkpoint", str(checkpoint),
                       "--nproc", "2"]}
    with ThreadPoolExecutor(len(commands)) as pool:
        results = list(pool.map(lambda command: run_cli(*command), commands.values()))
    return {name: (folders[name], result) for name, result in zip(commands, results)}


@pytest.mark.slow
def test_a_refusal_made_against_the_model_ends_bin_llmtune_with_one_line_and_exit_2(launches):
    folder, result = launches["model"]
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "llmtune: error: peft.target_modules: ['qkv_proj'] matches no layer of the model; name layers of the model "
        "(down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj) or use all-linear"), result.stderr
    assert not (folder / "out").exists()


@pytest.mark.slow
def test_bad_data_row_on_two_processes_exits_2_naming_file_and_line(launches):
    folder, result = launches["bad_row"]
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"llmtune: error: {folder / 'bad.jsonl'}:2: not valid JSON" in result.stderr
    assert not (folder / "out").exists()


@pytest.mark.parametrize("tracker", ["tensorboard", "wandb", "mlflow"])
def test_optional_sink_without_its_package_is_refused_up_front(tmp_path, recipe, monkeypatch, capsys, tracker):
    """The tests' environment has every tracker's package: this one is hidden from the CLI's check."""
    import importlib.util

    from llmtune.run import cli

    find = importlib.util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == tracker else find(name, *a))
    assert cli.main(["sft", recipe(), "--report_to", tracker]) == 2
    assert (f"monitor.report_to: {tracker} needs the {tracker} package, which is not installed; "
            f"pip install 'llmtune[{tracker}]', or take {tracker} out of monitor.report_to") in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_peft_without_its_package_is_refused_up_front(tmp_path, recipe, monkeypatch, capsys):
    """peft is a dependency, but an environment can lack it: the CLI's check, with peft hidden from it."""
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "peft" else find(name, *a))
    result = in_process(capsys, "sft", recipe(peft__method="lora"))
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "llmtune: error: peft.method: lora needs the peft package, which is not installed; pip install peft, or "
        "set peft.method: none"]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_an_incomplete_checkpoint_to_resume_from_stops_every_rank_with_its_name(launches):
    """Checked on rank 0 alone and the verdict shared: no rank goes on to wait for the others."""
    folder, result = launches["incomplete"]
    checkpoint = folder / "global_step_3"
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"llmtune: error: {checkpoint}: incomplete checkpoint, missing .metadata, trainer_state.json" in result.stderr
    assert not (folder / "out").exists()


@pytest.mark.slow
def test_a_dataset_info_entry_naming_a_missing_file_and_a_tool_result_without_a_call_exit_2(tmp_path, recipe, capsys,
                                                                                          launches):
    """The missing file is found before the run starts, the tool result by the worker of the one-process run."""
    (tmp_path / "dataset_info.json").write_text(TOOL_CALLS["dataset_info.json"])
    result = in_process(capsys, "sft", recipe(data__train_files=[], data__dataset_info=str(tmp_path),
                                               data__datasets=["calls"]))
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        f"llmtune: error: data.datasets: 'calls' in {tmp_path / 'dataset_info.json'}: file_name 'calls.json' does not "
        f"exist ({tmp_path / 'calls.json'}); fix file_name or add the file"]
    folder, result = launches["worker"]
    assert result.returncode == 2, result.stderr[-2000:]
    assert (f"llmtune: error: {folder / 'calls.json'}: row 1: message 1 is a tool result after a user turn with no "
            "tool call before it") in result.stderr
    assert not (folder / "out").exists()


def test_wandb_without_a_login_is_refused_up_front(tmp_path, recipe):
    """No WANDB_API_KEY, no `wandb login` (a fresh HOME), not offline: wandb.init would fail only once the data is
    built and the model loaded."""
    env = {"HOME": str(tmp_path), "WANDB_API_KEY": None, "WANDB_MODE": None,
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb"), "NETRC": str(tmp_path / "no-netrc")}
    result = run_cli("sft", recipe(), "--report_to", "wandb", env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "llmtune: error: monitor.report_to: wandb has no W&B login on this machine; set WANDB_API_KEY or run wandb "
        "login, or train offline with WANDB_MODE=offline (then wandb sync the run under OUTPUT_DIR/wandb), or take "
        "wandb out of monitor.report_to"]
    assert not (tmp_path / "out").exists()
