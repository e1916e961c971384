"""The work of benchmarks/device/proof.py's stages, each run in a process of its own (`run_stage`): env (a), tests (b),
profile, speed and extra (c), memory (d); the runs stage (b) is benchmarks/device/runs.py, the profile's reading of
its traces benchmarks/device/profiling.py. Each item's result goes to the stage's Results as it ends."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

from benchmarks.device.items import NO_CUDA, RESULTS_ENV, Failed, Results, Skipped, last_lines, planned_gib

REPO = Path(__file__).resolve().parents[2]


def env_stage(results: Results, work: Path, out: Path, dry_run: bool) -> None:
    """a. What ran the proof. GPU facts are skipped without CUDA; a package not installed is skipped, by name."""
    import importlib.metadata
    import platform

    import torch

    def gpu() -> dict:
        if not torch.cuda.is_available():
            raise Skipped(NO_CUDA)
        props = torch.cuda.get_device_properties(0)
        return {"value": f"{props.name}, {props.total_memory / 2**30:.1f} GiB, compute capability "
                         f"{props.major}.{props.minor}, {torch.cuda.device_count()} visible"}

    def driver() -> dict:
        if not torch.cuda.is_available():
            raise Skipped(NO_CUDA)
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
        return {"value": done.stdout.strip() or done.stderr.strip()}

    def cuda() -> dict:
        if not torch.cuda.is_available():  # a CUDA build on a machine without a GPU (the mirror environment) too
            build = "a CPU build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise Skipped(f"{NO_CUDA}: torch {torch.__version__} is {build}, and no device is visible")
        nccl = torch.cuda.nccl.version()  # a tuple, an int in older torch
        nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
        return {"value": f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, NCCL {nccl}"}

    def version(package: str) -> Callable[[], dict]:
        def read() -> dict:
            try:
                return {"value": importlib.metadata.version(package)}
            except importlib.metadata.PackageNotFoundError:
                raise Skipped(f"{package} is not installed") from None
        return read

    def wheels() -> dict:
        folders = [Path(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        found = sorted(d.name.removesuffix(".dist-info") for f in folders if f.is_dir() for d in f.glob("*.dist-info"))
        return {"value": ", ".join(found) or "none (no package folder on PYTHONPATH)"}

    def commit() -> dict:
        done = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h %s"], capture_output=True,
                              text=True)
        if done.returncode:
            raise Skipped("not a git checkout")
        return {"value": done.stdout.strip()}

    results.run("python", lambda: {"value": f"{platform.python_version()} on {platform.platform()}, "
                                            f"{os.cpu_count()} CPUs"})
    results.run("GPU", gpu)
    results.run("driver (nvidia-smi)", driver)
    results.run("torch", lambda: {"value": torch.__version__})
    results.run("CUDA", cuda)
    for package in ("triton", "transformers", "peft", "datasets", "accelerate", "torchao", "liger-kernel",
                    "flash-attn", "kernels", "pytest"):
        results.run(package, version(package))
    results.run("wheels on PYTHONPATH", wheels)
    results.run("llmtune commit", commit)


def tests_stage(results: Results, work: Path, out: Path, dry_run: bool) -> None:
    """b. The tests marked cuda, in the files that mark them, run by pytest with benchmarks/device/items.py as a
    plugin: each test's outcome lands in the results as it ends. pytest ending otherwise than with its tests' outcomes
    (a file that does not import, say) is an item of its own."""
    import importlib.util

    def pytest_ended(reason: str) -> Callable[[], None]:
        def item() -> None:
            raise Failed(reason) if reason.startswith("pytest exited") else Skipped(reason)
        return item

    if importlib.util.find_spec("pytest") is None:
        results.run("pytest", pytest_ended("pytest is not installed"))
        return
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                   if "pytest.mark.cuda" in p.read_text())
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "benchmarks.device.items", "-m", "cuda", "-rs",
                           "-q", "-p", "no:cacheprovider", *files], cwd=REPO,
                          env={**os.environ, RESULTS_ENV: str(results.path)}, capture_output=True, text=True)
    print(done.stdout + done.stderr)
    if done.returncode not in (0, 1):  # 1: a test failed, in its own row
        results.run("pytest", pytest_ended(f"pytest exited {done.returncode}:\n"
                                           f"{last_lines(done.stdout + done.stderr)}"))


class Speed:
    """c. benchmarks/gpu.py's runs of `llmtune pt` (bf16, packed rows; the document mask off, so that llmtune does
    the plain loop's attention work) and the plain loop, on the same model config and corpus."""

    def __init__(self, work: Path, dry_run: bool):
        import torch

        from benchmarks import gpu

        self.gpu, self.cuda = gpu, torch.cuda.is_available()
        size = ["--seq", "128", "--steps", "2", "--warmup", "1"] if dry_run else ["--seq", "8192", "--steps", "5",
                                                                                 "--warmup", "3"]
        self.args = gpu.build_parser().parse_args([*size, "--batch", "1", "--document-mask", "off"])
        self.shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=128, vocab_size=512, tie_word_embeddings=True) if dry_run else \
            gpu.SHAPES["1b"][1]
        self.folder = work / "speed"
        # Written once for both speed stages: the runs of the second read the first's corpus and model config.
        if not (self.folder / "corpus.jsonl").exists():
            gpu.write_inputs(self.folder, self.shape, self.args, 1)
        self.inputs = (self.folder / "model", self.folder / "assets" / "tokenizer", self.folder / "corpus.jsonl")

    def llmtune(self, checkpointing: bool | str, compiled: bool, fp8: bool | str) -> dict:
        """checkpointing: train.gradient_checkpointing's value (true, selective, auto); fp8 train.fp8's."""
        label = f"ac{checkpointing}_compile{int(compiled)}_fp8{fp8 or 0}"
        recipe = self.gpu.write_recipe(self.folder / label, self.inputs, self.args, checkpointing, compiled, fp8)
        result = self.gpu.measure(recipe, 1, self.args.warmup)
        if "failed" in result:
            raise Failed(last_lines((recipe.parent / "llmtune.log").read_text()))
        # On a CPU the run's peak is its RSS, which the plan does not count.
        return {"tokens_per_s": result["tokens_per_gpu"], "mfu": result["mfu"],
                "planned_gib": planned_gib(recipe, "pt"), "peak_gib": result["mem_gib"] if self.cuda else None}

    def job(self, command: list[str], log: Path) -> str:
        """The output of `command`, the one process of its job (torchrun's variables set here: torchrun would only
        add its start-up), also written to `log`; Failed with its last lines if it fails."""
        from tests.helpers import free_port

        job = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port())}
        with log.open("w") as f:
            done = subprocess.run(command, cwd=REPO, env={**os.environ, **job}, stdout=f, stderr=subprocess.STDOUT)
        if done.returncode:
            raise Failed(f"exit {done.returncode}:\n{last_lines(log.read_text())}")
        return log.read_text()

    def plain(self) -> dict:
        """benchmarks/plain_fsdp_loop.py (bf16, activation checkpointing); its MFU counted as llmtune's monitor
        counts it."""
        import statistics

        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from llmtune.monitor.metrics import flops_per_token, peak_tflops

        model, tokenizer, corpus = self.inputs
        args = self.args
        output = self.job([sys.executable, str(REPO / "benchmarks" / "plain_fsdp_loop.py"), str(model), str(tokenizer),
                           str(corpus), str(args.seq), str(args.batch), str(args.warmup + args.steps),
                           str(args.warmup), "--bf16", "--checkpointing"], self.folder / "plain.log")
        result = json.loads(next(line for line in reversed(output.splitlines()) if line.startswith("{")))
        tokens_per_s = result["tokens_per_step"] / statistics.median(result["step_times_s"])
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
        peak = peak_tflops(None)
        return {"tokens_per_s": tokens_per_s,
                "mfu": flops_per_token(meta, args.seq) * tokens_per_s / (peak * 1e12) if peak else None,
                "peak_gib": result["peak_gib"]}

    def torchtitan(self, checkpointing: str = "full", compiled: bool = False) -> dict:
        """torchtitan's llama3 trainer, where installed (it is optional), on the same shape (a flavor of its own),
        corpus (its c4_test loader reads a folder of JSON lines), steps and bf16, with its activation checkpointing
        `checkpointing` (full, or selective: its op-level policy, which llmtune's selective follows) and
        torch.compile where `compiled`; tokens/s, MFU and memory as its log gives them."""
        import importlib.util
        import shutil
        import statistics

        if not self.cuda:
            raise Skipped(f"{NO_CUDA}: torchtitan trains on a GPU")
        if importlib.util.find_spec("torchtitan") is None:
            raise Skipped("torchtitan is not installed (optional: the plain loop is the reference)")
        shape, args = self.shape, self.args
        label = f"{checkpointing}_compile{int(compiled)}"
        data = self.folder / "titan_data"
        data.mkdir(exist_ok=True)
        shutil.copy(self.inputs[2], data / "corpus.jsonl")
        # torchtitan's FFN width: 8/3 x dim, times ffn_dim_multiplier, rounded up to multiple_of: 8,192 for
        # Llama-3.2-1B's 2,048 (its intermediate_size). Its output layer is never tied to the embeddings.
        flavor = (f"TransformerModelArgs(dim={shape['hidden_size']}, n_layers={shape['num_hidden_layers']}, "
                  f"n_heads={shape['num_attention_heads']}, n_kv_heads={shape['num_key_value_heads']}, "
                  f"vocab_size={shape['vocab_size']}, ffn_dim_multiplier=1.5, multiple_of=256, rope_theta=500000)")
        code = ("from torchtitan.models.llama3 import TransformerModelArgs, llama3_args\n"
                f"llama3_args['llmtune_proof'] = {flavor}\n"
                "from torchtitan.train import Trainer, main\n"
                "main(Trainer)\n")
        output = self.job([sys.executable, "-c", code, "--model.name=llama3", "--model.flavor=llmtune_proof",
                           f"--model.hf_assets_path={self.inputs[1]}", "--training.dataset=c4_test",
                           f"--training.dataset_path={data}", f"--training.seq_len={args.seq}",
                           f"--training.local_batch_size={args.batch}", f"--training.steps={args.warmup + args.steps}",
                           "--lr_scheduler.warmup_steps=1", f"--activation_checkpoint.mode={checkpointing}",
                           *(["--activation_checkpoint.selective_ac_option=op"] if checkpointing == "selective"
                             else []), *(["--compile.enable"] if compiled else []),
                           "--metrics.log_freq=1", "--metrics.disable_color_printing",
                           f"--job.dump_folder={self.folder / f'titan_{label}'}"],
                          self.folder / f"torchtitan_{label}.log")
        steps = [(int(m[1]), float(m[2]), float(m[3].replace(",", "")), float(m[4])) for m in re.finditer(
            r"step:\s*(\d+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+).*?mfu:\s*([\d.]+)%", output)]
        timed = [step for step in steps if step[0] > args.warmup]
        if not timed:
            raise Failed(f"no step after the warm-up in torchtitan's log:\n{last_lines(output)}")
        return {"tokens_per_s": statistics.median(s[2] for s in timed), "mfu": statistics.median(s[3] for s in timed)
                / 100, "peak_gib": max(s[1] for s in timed), "note": "peak: torchtitan's max reserved memory"}


def speed_stage(results: Results, work: Path, out: Path, dry_run: bool) -> None:
    speed = Speed(work, dry_run)
    results.run("llmtune: bf16, activation checkpointing", lambda: speed.llmtune(True, False, False))
    results.run("plain FSDP2 loop: bf16, activation checkpointing", speed.plain)


PROFILED_STEPS = 3
TRACE = "llmtune_step.pt.trace.json"  # in OUT
TRACE_LIMIT_MIB = 16  # the most a file may weigh to come back from a lent machine


def profile_stage(results: Results, work: Path, out: Path, dry_run: bool) -> None:
    """c. torch.profiler over PROFILED_STEPS steps, after the speed stage's warm-up, of llmtune (its own
    monitor.profile_steps) and of the plain loop (the same profiler and options), both in this process on the speed
    stage's inputs: each one's time by category (benchmarks/device/profiling.py), the table of both, and llmtune's
    middle step as a Chrome trace in OUT."""
    import gc

    import torch

    import llmtune
    from benchmarks.device import profiling
    from benchmarks.plain_fsdp_loop import PlainLoop
    from llmtune.config import MonitorConfig
    from llmtune.monitor.metrics import StepProfiler
    from llmtune.run.parallel import ParallelState

    speed = Speed(work, dry_run)
    window = [speed.args.warmup + 1, speed.args.warmup + PROFILED_STEPS]  # 1-based optimizer steps
    folders = {"llmtune": speed.folder / "profile" / "llmtune", "plain": speed.folder / "profile" / "plain"}
    names = {"llmtune": "llmtune: time by category", "plain": "plain FSDP2 loop: time by category"}

    def trace(runner: str) -> dict:
        path, = (folders[runner] / "profile").glob("*.pt.trace.json")
        return json.loads(path.read_text())

    def llmtune_steps() -> dict:
        recipe = speed.gpu.write_recipe(folders["llmtune"], speed.inputs, speed.args, True, False, False)
        llmtune.train("pt", str(recipe), train={"max_steps": window[1]},
                      monitor={"profile_steps": window, "plots": False})
        return {"breakdown": profiling.breakdown(trace("llmtune"), PROFILED_STEPS)}

    def llmtune_step_trace() -> dict:
        if "breakdown" not in results.rows[names["llmtune"]]:
            raise Skipped(f"ran, but {names['llmtune']} did not pass: no trace")
        text = json.dumps(profiling.one_step(trace("llmtune")), separators=(",", ":"))
        mib = round(len(text) / 2**20, 2)
        if mib > TRACE_LIMIT_MIB:
            raise Failed(f"one step's trace is {mib} MiB, over the {TRACE_LIMIT_MIB} MiB a file comes back with",
                         trace_mib=mib)
        (out / TRACE).write_text(text)
        return {"trace": TRACE, "trace_mib": mib}

    def plain_steps() -> dict:
        gc.collect()  # llmtune's run is over: what it left goes back before the plain loop builds its model
        if speed.cuda:
            torch.cuda.empty_cache()
        state = ParallelState.initialize()
        model, tokenizer, corpus = speed.inputs
        loop = PlainLoop(str(model), str(tokenizer), str(corpus), speed.args.seq, speed.args.batch, state.fsdp_mesh,
                         bf16=True, checkpointing=True)
        profiler = StepProfiler(MonitorConfig(profile_steps=window), folders["plain"], 0)
        for step in range(1, window[1] + 1):
            loop()
            profiler.step(step == window[1])
        state.close()
        return {"breakdown": profiling.breakdown(trace("plain"), PROFILED_STEPS)}

    def compared() -> dict:
        """The table, with the column of a run that did not pass left empty."""
        breakdowns = [results.rows[name].get("breakdown") for name in names.values()]
        if breakdowns == [None, None]:
            raise Skipped("neither run passed: nothing to compare")
        return {"table": profiling.comparison(*breakdowns),
                "source": "CUDA kernels" if speed.cuda else "CPU operators' self time (no CUDA)"}

    results.run(names["llmtune"], llmtune_steps)
    results.run("llmtune: one step's Chrome trace", llmtune_step_trace)
    results.run(names["plain"], plain_steps)
    results.run("llmtune against the plain loop", compared)


def extra_stage(results: Results, work: Path, out: Path, dry_run: bool) -> None:
    """c, the rest: the speed stage's llmtune run with torch.compile, then with float8 tensorwise too; torchtitan
    beside it at equal activation checkpointing, eager and compiled (full, then selective on both); llmtune with
    checkpointing auto; float8 rowwise. The most wanted first: the stage's budget may end before the last."""
    speed = Speed(work, dry_run)

    def compiled(fp8: bool | str, checkpointing: bool | str = True) -> dict:
        from llmtune.features.float8 import device_problem

        problem = device_problem() if fp8 else None
        if problem:
            raise Skipped(problem if speed.cuda else f"{NO_CUDA}: {problem}")
        if not speed.cuda:
            raise Skipped(f"{NO_CUDA}: the dry run leaves out compiling (minutes on a CPU; the suite compiles there)")
        return speed.llmtune(checkpointing, True, fp8)

    results.run("llmtune: bf16, activation checkpointing, torch.compile", lambda: compiled(False))
    results.run("llmtune: bf16, activation checkpointing, torch.compile, float8 tensorwise",
                lambda: compiled("tensorwise"))
    results.run("torchtitan: bf16, full activation checkpointing", speed.torchtitan)
    results.run("torchtitan: bf16, full activation checkpointing, torch.compile", lambda: speed.torchtitan("full", True))
    results.run("llmtune: bf16, selective activation checkpointing, torch.compile",
                lambda: compiled(False, "selective"))
    results.run("torchtitan: bf16, selective activation checkpointing (op), torch.compile",
                lambda: speed.torchtitan("selective", True))
    results.run("llmtune: bf16, activation checkpointing auto, torch.compile", lambda: compiled(False, "auto"))
    results.run("llmtune: bf16, activation checkpointing, torch.compile, float8 rowwise", lambda: compiled("rowwise"))


def memory_stage(results: Results, work: Path, out: Path, dry_run: bool) -> None:
    """d. benchmarks/chunk_loss.py's loss cases, each in a fresh process: full logits, llmtune's default chunk and
    Liger's fused linear cross-entropy, bf16 on CUDA (fp32 tiny shapes on a CPU)."""
    import importlib.util
    from dataclasses import fields

    import torch

    from benchmarks.chunk_loss import run_child
    from llmtune.config import TrainConfig

    cuda = torch.cuda.is_available()
    default_chunk = next(f.default for f in fields(TrainConfig) if f.name == "chunk_loss_size")
    argv, chunk = (["--device", "cuda", "--dtype", "bfloat16", "--tokens", "8192", "--vocab", "151936"],
                   default_chunk) if cuda else (["--device", "cpu", "--tokens", "256", "--hidden", "64", "--vocab",
                                                 "2048"], 64)

    def case(kind: str, size: int) -> Callable[[], dict]:
        def measure() -> dict:
            if kind == "fused" and not cuda:
                raise Skipped(f"{NO_CUDA}: Liger's kernels run on CUDA only")
            if kind == "fused" and importlib.util.find_spec("liger_kernel") is None:
                raise Skipped("liger-kernel is not installed")
            result = run_child(f"{kind}:{size}", argv)
            return {"peak_mib": result["peak_mib"], "loss_ms": 1000 * result["seconds"], "loss": result["loss"]}
        return measure

    results.run("loss: full logits", case("loss", 0))
    results.run(f"loss: chunked, {chunk} tokens", case("loss", chunk))
    results.run("loss: Liger fused linear cross-entropy", case("fused", 0))


def runs_stage(results: Results, work: Path, out: Path, dry_run: bool) -> None:
    from benchmarks.device.runs import run_cases

    run_cases(results, work / "runs", dry_run)


WORK = {"env": env_stage, "tests": tests_stage, "runs": runs_stage, "profile": profile_stage, "speed": speed_stage,
        "memory": memory_stage, "extra": extra_stage}


def run_stage(name: str, work: Path, out: Path, dry_run: bool) -> None:
    """A stage's process: its items into WORK/<name>.jsonl, what it hands back beside the reports into OUT."""
    if dry_run:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the dry run is a CPU's, on any machine
    WORK[name](Results(work / f"{name}.jsonl"), work, out, dry_run)
