"""Helpers the tests share: the CLI as a user runs it, and its outputs."""

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from llmtune.tasks.registry import TASKS

REPO = Path(__file__).resolve().parents[1]


def without_plots(args) -> list[str]:
    """Overrides, or a command line, with monitor.plots=false added unless they set monitor.plots: drawing the curves
    at a run's end takes a second, which only the tests that read the plots spend."""
    return list(args) if any("monitor.plots" in arg for arg in args) else [*args, "monitor.plots=false"]


def cli_words(args) -> list[str]:
    """A command line as the tests give bin/llmtune: a training command without plots (without_plots)."""
    return without_plots(args) if args and args[0] in TASKS else list(args)


def run_cli(*args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """bin/llmtune as a user runs it, from the repository root (no plots: without_plots); env: variables to add
    (None: to remove)."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}, **(env or {})}
    env = {k: v for k, v in env.items() if v is not None}
    return subprocess.run([str(REPO / "bin" / "llmtune"), *cli_words(args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def run_cli_imports(*args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, set[str]]:
    """run_cli with Python's import-time report on (python -X importtime): the result, its stderr without the report,
    and the packages the command imported (their top-level names): which a refusal must not have waited for."""
    result = run_cli(*args, env={**(env or {}), "PYTHONPROFILEIMPORTTIME": "1"})
    lines = result.stderr.splitlines(keepends=True)
    result.stderr = "".join(line for line in lines if not line.startswith("import time:"))
    return result, {line.rpartition("|")[2].strip().split(".")[0] for line in lines if line.startswith("import time:")}


class StopAt:
    """A callback (llmtune's need no base class) that stops training after optimizer step `step`."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.step == self.step


def train_and_export(config, then):
    """A run of the loaded recipe `config` as the worker wires it, in this process with the trained model at hand:
    trained, exported to its output_dir, then then(trainer, tokenizer, state) before the process group closes.
    Returns what `then` returns."""
    from llmtune.checkpoint.hf_export import export_trained
    from llmtune.run.inputs import check_inputs
    from llmtune.run.parallel import ParallelState
    from llmtune.run.worker import build_trainer

    state = ParallelState.initialize()
    try:
        check_inputs(config)
        trainer, tokenizer = build_trainer(config, state)
        trainer.train()
        export_trained(trainer.model, tokenizer, Path(config.train.output_dir), config.checkpoint, state,
                       trainer.features)
        return then(trainer, tokenizer, state)
    finally:
        state.close()


def needs_cpu_float8(on_cpu: bool = True):
    """Skips a test that multiplies in float8 with rowwise scales on the CPU (train.fp8's recipe) where torch cannot:
    its CPU _scaled_mm takes per-tensor scales alone before 2.13 (an internal assert)."""
    import torch

    return pytest.mark.skipif(on_cpu and torch.__version__ < (2, 13),
                              reason=f"torch {torch.__version__} has no rowwise float8 matmul on the CPU (2.13 has)")


@contextlib.contextmanager
def emulated_float8_matmul():
    """torch's float8 matmul (torch._scaled_mm) on the CPU by its emulation on every CPU: inputs upcast to fp32 and
    scaled, then one fp32 matmul. Why: on a CPU with AMX (aten's Blas.cpp: AMX-INT8, or AMX-FP16 where the operands'
    float8 kinds differ, as in the backward's e5m2 x e4m3) torch sends it to oneDNN instead, whose float8 matmul took
    about 6 minutes a step of tests/e2e/test_fp8_run.py's model on such a machine, against seconds here (AMD, no AMX,
    the emulation). oneDNN is off for the whole block (the switch Blas.cpp reads before choosing it), not around each
    call, so that a compiled layer, which calls aten's _scaled_mm from its graph, takes the emulation too. The rest of
    the run (torchao's casts and scales, the bf16 layers) is as it is."""
    import torch

    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


@contextlib.contextmanager
def gloo_float8_all_gather():
    """FSDP2's all-gathers of float8 weights (train.fp8 tensorwise) over gloo, which takes no float8 dtype ("Invalid
    scalar type"): the bytes gathered as uint8, which is what NCCL moves too."""
    import torch
    import torch.distributed as dist

    all_gather = dist.all_gather_single
    float8 = (torch.float8_e4m3fn, torch.float8_e5m2)

    def as_bytes(output, tensor, *args, **kwargs):
        if tensor.dtype in float8:
            output, tensor = output.view(torch.uint8), tensor.view(torch.uint8)
        return all_gather(output, tensor, *args, **kwargs)

    dist.all_gather_single = as_bytes  # what FSDP2's all-gather calls (fsdp/_fully_shard/_fsdp_collectives.py)
    try:
        yield
    finally:
        dist.all_gather_single = all_gather


def compile_with_backend(monkeypatch, backend: str) -> None:
    """Module.compile (what train.compile calls on each decoder layer) with `backend` for the rest of the test; the
    counts of dynamo (breaks, graphs) are decided before any backend runs."""
    import torch

    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda module, **kwargs: compile_module(module, backend=backend, **kwargs))


def write_pairs(assets: Path, count: int, path: Path) -> Path:
    """The demo's first `count` preference pairs (assets: the demo's folder) at `path`, every third one's answers
    three times as long, so that packed rows hold 1, 2 or 3 pairs."""
    rows = [json.loads(line) for line in (assets / "data" / "dpo_train.jsonl").read_text().splitlines()[:count]]
    for row in rows[::3]:
        for key in ("chosen", "rejected"):
            row[key][0]["content"] = " and ".join([row[key][0]["content"]] * 3)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


# fp32's machine epsilon, 2**-23 ~ 1.19e-7: the relative error of one rounding.
EPS32 = 2.0 ** -23


def near(expected, scale: float, rel: float = 1e-5, ulps: float = 8):
    """pytest.approx for an fp32 result that can be near 0 next to the inputs it is computed from (a margin of two
    rewards, a mean reward, grpo's loss at importance ratio 1, a KL): relative `rel`, and absolute ulps x EPS32 x
    scale, `scale` being the inputs' magnitude (a bound on it, not the result's). Adding the same inputs in another
    order (another layout, another CPU's vector kernels) leaves a few of their roundings in the result however small it
    is, which a relative tolerance alone does not allow (pytest.approx's own absolute one is 1e-12). 8: the few
    roundings that survive, with room; the layouts these tests compare differed by at most 0.4 x EPS32 x scale, with
    AVX-512 kernels and with plain SSE ones (ATEN_CPU_CAPABILITY=default, MKL_ENABLE_INSTRUCTIONS=SSE4_2)."""
    return pytest.approx(expected, rel=rel, abs=ulps * EPS32 * scale)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def offline_hub(hf_home: Path) -> dict:
    """The environment of a run that reads the huggingface_hub cache under hf_home and never the network."""
    return {"HF_HOME": str(hf_home), "HF_HUB_CACHE": str(hf_home / "hub"),
            "HF_DATASETS_CACHE": str(hf_home / "datasets"), "HF_HUB_OFFLINE": "1"}


def add_to_hub_cache(hf_home: Path, repo_id: str, kind: str, files: Path, commit: str, refs: tuple[str, ...] = (),
                     not_fetched: tuple[str, ...] = ()) -> Path:
    """One commit of a Hub repository in the huggingface_hub cache under hf_home, laid out as a download leaves
    it: snapshots/<commit>/ holds the files (copies of those in `files`), refs/<name> the commit of each branch
    or tag in refs, and trees/<commit>.json the commit's file list (huggingface_hub 2.2 and later refuse a
    snapshot that lacks a listed file its download asked for), which also names the files in not_fetched,
    left on the Hub. Returns the snapshot folder."""
    repo = hf_home / "hub" / f"{kind}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(files, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        # huggingface_hub reads the commit as the file's whole text: no newline.
        (repo / "refs" / ref).write_text(commit)
    listed = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()] + list(not_fetched)
    (repo / "trees").mkdir(exist_ok=True)
    (repo / "trees" / f"{commit}.json").write_text(json.dumps(
        {"format_version": 1, "files": {name: {"size": 1, "blob_id": "0" * 40} for name in listed}}))
    return snapshot


def start_cli(*args: str) -> subprocess.Popen:
    """bin/llmtune in the background (no plots: without_plots)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.Popen([str(REPO / "bin" / "llmtune"), *cli_words(args)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def descendants(pid: int) -> list[int]:
    """Every process below pid. torchrun starts its workers in new sessions, so a process group kill
    would miss them: walk the parent links instead."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL a process and all its descendants at once, as a crashed machine would stop them."""
    import signal

    for pid in [process.pid, *descendants(process.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def save_tiny_model(path: Path, model_cls, tokenizer, seed: int = 0, **config) -> Path:
    """A random tiny model of `model_cls` sized for the demo tokenizer, saved with it as a HF folder."""
    import torch

    defaults = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model_cls(model_cls.config_class(**{**defaults, **config})).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def byte_level_tokenizer(folder: Path, chat_template: str, extra_specials: tuple[str, ...] = (),
                         named: dict | None = None):
    """A byte-level BPE trained on a few lines, with ChatML's special tokens (and `extra_specials`) and
    `chat_template`, saved in `folder` and loaded: every character encodes and offsets exist, as for the tokenizers
    users fine-tune. `named`: attributes naming special tokens (Gemma 3's boi_token), as a family's tokenizer has
    them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = ["What is 2 plus 3? It is 5.", "Add the numbers with the tool.", "The sum is five.",
              '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', "<think>\nI add them.\n</think>"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_specials]
    bpe.train_from_iterator(corpus * 20, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    extra = {"extra_special_tokens": named} if named else {}  # without them, the folder as it was
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                            chat_template=chat_template, **extra).save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def segment_ids(tokenizer, segments) -> tuple[list[int], list[int]]:
    """(text, trained) segments in order -> (input_ids, labels), each segment tokenized alone: the expected ids of
    the golden tests, built from literal text rather than from the code under test."""
    ids, labels = [], []
    for text, trained in segments:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if trained else [-100] * len(piece)
    return ids, labels


def offline_trackers(patch, folder: Path) -> None:
    """W&B offline with its own folders under `folder`, MLflow's file store in output_dir (no MLFLOW_TRACKING_URI):
    nothing reaches the network. `patch`: a pytest MonkeyPatch; each variable is recorded before it is removed, so
    that what the trackers set is undone with it."""
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        patch.setenv(name, str(folder / name.lower()))
    patch.setenv("WANDB_MODE", "offline")
    patch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_PROJECT", "WANDB_API_KEY", "WANDB_RESUME", "WANDB_RUN_ID", "MLFLOW_TRACKING_URI",
                 "MLFLOW_EXPERIMENT_NAME", "MLFLOW_ALLOW_FILE_STORE"):
        patch.setenv(name, "")
        patch.delenv(name)


def misfit_copy(model: Path, folder: Path) -> dict:
    """A copy of the HF folder `model` in `folder` whose weights do not fit its config: a layer's down_proj and the
    final norm left out, the lm_head 4 rows short, and a tensor the model has no place for. Returns the tensors
    written."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, folder, dirs_exist_ok=True)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.0.mlp.down_proj.weight"], tensors["model.norm.weight"]
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:-4].clone()
    tensors["model.extra.weight"] = torch.zeros(3)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return tensors


def launch_cases(cases: list[dict], folder: Path, nproc: int = 2, timeout: int = 900) -> None:
    """Train `cases` (tests/dist/case_worker.py's) one after another in one torchrun launch of `nproc` processes;
    fails the test with the launch's last error lines."""
    with cases_launched(cases, folder, nproc, timeout):
        pass


@contextlib.contextmanager
def cases_launched(cases: list[dict], folder: Path, nproc: int = 2, timeout: int = 900):
    """launch_cases' launch, running while the body of the with block does (the one-process references train in
    this process meanwhile), waited for as the block ends. Its list is written to folder/cases.json, its output to a
    file (a pipe nobody reads until the end would stop its workers once full). The repository is on the workers'
    path, as pytest's is, for the callbacks a case's recipe names from tests/."""
    spec = folder / "cases.json"
    spec.write_text(json.dumps(cases))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    log = folder / "launch.log"
    with log.open("w") as output:
        launch = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   f"--nproc-per-node={nproc}", str(REPO / "tests" / "dist" / "case_worker.py"),
                                   str(spec)], cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT, text=True)
        try:
            yield
            launch.wait(timeout=timeout)
        finally:
            launch.kill()  # a no-op once it has ended; else the body failed or the launch ran out of time
    assert launch.returncode == 0, log.read_text()[-6000:]


def saved_state(folder: Path, tmp_path: Path) -> dict:
    """A DCP checkpoint folder's whole content (model and optimizer, every tensor whole), read in this process."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp_path / f"{folder.parent.parent.name}.pt"
    dcp_to_torch_save(folder, target)
    return torch.load(target, weights_only=True)


def flat(state, prefix: str = "") -> dict:
    """Every leaf of a nested checkpoint state, by its dotted path."""
    if isinstance(state, dict):
        return {key: value for name, sub in state.items() for key, value in flat(sub, f"{prefix}{name}.").items()}
    return {prefix[:-1]: state}


def assert_loads_bitwise(written: dict, reloaded: dict, layout: str) -> None:
    """Two flat checkpoint states (flat(saved_state(...))) hold the same keys and every value bitwise."""
    import torch

    assert reloaded.keys() == written.keys(), layout
    for key, value in written.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(reloaded[key], value), f"{layout}: {key}"
        else:
            assert reloaded[key] == value, f"{layout}: {key}"


def script_module(script: Path):
    """A script of benchmarks/ (or docs/) as a module: those folders hold scripts, not packages, so it is loaded from
    its file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def undocumented_options(script: Path) -> list:
    """The options of a benchmark script's build_parser() without help, or missing from its --help output (an option
    hidden on purpose, help=SUPPRESS, is neither). benchmarks/ is a folder of scripts, not a package: the module is
    loaded from its file."""
    import argparse

    module = script_module(script)
    options = [action for action in module.build_parser()._actions
               if not isinstance(action, argparse._HelpAction) and action.help != argparse.SUPPRESS]
    assert options, f"{script.name} has no options"
    shown = set(subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                               check=True).stdout.split())
    return [action.option_strings for action in options if not action.help or not set(action.option_strings) & shown]


def export_greedy(folder: Path):
    """transformers' own greedy generate of an exported HF folder: a function (prompt in TRL's forms, new tokens) ->
    the completion's token ids, stopping at the EOS ids llmtune's engine stops at."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmtune.data.prompts import prompt_ids
    from llmtune.generation.prompts import stop_ids

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    eos = stop_ids(tokenizer, model.generation_config)

    def greedy(prompt, new_tokens: int) -> list[int]:
        ids = prompt_ids(tokenizer, prompt)
        return model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=new_tokens, eos_token_id=eos,
                              pad_token_id=tokenizer.pad_token_id)[0, len(ids):].tolist()
    return greedy
