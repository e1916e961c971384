"""TrainMonitor: per-step numbers -> logged records (metrics.jsonl, console, progress bar, the trackers of
trackers.py), and the profiler's traces of chosen steps.

Every number is global (summed over ranks by the trainer before it gets here) except memory,
which is this rank's. Only rank 0 writes records; every rank writes its own trace.
"""

import dataclasses
import json
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from llmtune.model.build import output_head
from llmtune.monitor.console import Console
from llmtune.monitor.trackers import Trackers

# Dense (no sparsity) bf16 peak TFLOP/s of one device, from the vendors' datasheets (NVIDIA's list "with sparsity",
# halved here; AMD's dense figure), by a substring of torch.cuda.get_device_name(): "NVIDIA H100 80GB HBM3" (SXM),
# "NVIDIA H100 PCIe", "AMD Instinct MI300X". The longest key found in the name wins (peak_tflops), so "H100 PCIe"
# beats "H100" and "L40S" beats "L4" whatever the order here. V100 has no bf16: its fp16 figure.
PEAK_TFLOPS = {
    "B200": 2250.0, "GB200": 2500.0,
    "H200": 989.0, "H200 NVL": 835.0, "GH200": 989.0,
    "H100": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0,
    "A100": 312.0, "A10G": 125.0, "L40S": 362.0, "L4": 121.0, "V100": 125.0, "RTX 4090": 165.0, "RTX 3090": 71.0,
    "MI300X": 1307.4, "MI300A": 980.6, "MI325X": 1307.4,
}


@dataclass
class StepRecord:
    """What the trainer knows about one optimizer step."""
    loss: float
    lr: float
    grad_norm: float
    label_tokens: int
    input_tokens: int
    samples: int
    step_time: float
    data_wait: float
    skipped: bool
    features: dict[str, float] = field(default_factory=dict)  # the features' step_metrics
    loss_scale: float | None = None  # train.fp16's, after the step


def restart_records(path: Path, step: int) -> None:
    """A JSONL file of records by step (metrics.jsonl, generations.jsonl) as training starts after `step`: removed at
    step 0; on resume, the records up to the checkpoint's step kept, those of later steps dropped (they are made
    again), and so is a last line an interruption cut short."""
    if step == 0:
        path.unlink(missing_ok=True)
        return
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break
        if record["step"] <= step:
            kept.append(line)
    path.write_text("".join(line + "\n" for line in kept))


def flops_per_token(hf_model, seq_len: int) -> float:
    """6 x the weights every token is multiplied by, forward and backward, plus attention's 12 x layers x query width x
    sequence (PaLM's estimate; 6 x layers x (key width + value width) x sequence where they differ). The weights are
    counted on the model itself, whatever its config calls its sizes: every matrix but the input embeddings (a
    lookup), and the lm_head even when it is the embedding. A mixture of experts multiplies each token by its
    experts per token alone: the stacked experts' matrices (transformers' *Experts modules, [experts, ...]) count
    experts-per-token / experts of their size, their biases nothing."""
    config = hf_model.config.get_text_config()
    lookups = {id(module.weight) for module in hf_model.modules() if isinstance(module, nn.Embedding)}
    experts = {id(p): config.num_experts_per_tok / module.num_experts
               for module in hf_model.modules() if type(module).__name__.endswith("Experts")
               for p in module.parameters()}
    matmul = sum(p.numel() * experts.get(id(p), 1) for p in hf_model.parameters()
                 if p.dim() >= (3 if id(p) in experts else 2) and id(p) not in lookups)
    head = output_head(hf_model).weight  # a sequence classifier's score head is a matrix of its own
    if id(head) in lookups:
        matmul += head.numel()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    # Queries x keys and weights x values, each 2 x 3 (forward, backward) FLOPs per product; MLA (DeepSeek) gives
    # keys and values widths of their own.
    widths = getattr(config, "qk_head_dim", head_dim) + getattr(config, "v_head_dim", head_dim)
    return 6.0 * matmul + 6.0 * config.num_hidden_layers * heads * widths * seq_len


def peak_tflops(configured: float | None) -> float | None:
    if configured:
        return configured
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    key = max((key for key in PEAK_TFLOPS if key in name), key=len, default=None)
    return PEAK_TFLOPS.get(key)


def memory_gib() -> tuple[float, float]:
    """(peak memory: CUDA max allocated, else peak RSS; current RSS), in GiB."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * resource.getpagesize() / 2**30
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30, rss
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, rss


class TrainMonitor:
    """recipe: the resolved recipe, for the trackers (their runs' config); unit: what the step's samples are
    (samples_per_s, or a task's own: pairs_per_s); shown: the task's metrics that the console's lines show after the
    loss (Objective.shown)."""

    def __init__(self, output_dir: Path, monitor_cfg, logging_steps: int, total_steps: int, flops_token: float,
                 world_size: int, rank: int, recipe: dict | None = None, unit: str = "samples",
                 shown: tuple[str, ...] = ()):
        self.unit = unit
        self.shown = shown
        self.logging_steps = logging_steps
        self.total_steps = total_steps
        self.flops_token = flops_token
        self.world_size = world_size
        self.peak = peak_tflops(monitor_cfg.peak_tflops)
        self.is_main = rank == 0
        self.monitor_cfg = monitor_cfg
        self.console = None  # rank 0's, from begin() to end()
        self.trackers = None  # rank 0's, from begin() to end(): only then is it known whether the run resumes
        self.recipe = recipe or {}
        self.output_dir = output_dir
        self.path = output_dir / "metrics.jsonl"
        self.profiler = StepProfiler(monitor_cfg, output_dir, rank)
        self.skipped_steps = 0
        self.first_step = 0
        self.started = time.perf_counter()
        self.window: list[StepRecord] = []
        self.window_started = self.started
        self.window_seconds = 0.0  # the time a resumed window's steps took before the checkpoint

    def state_dict(self) -> dict:
        """The steps since the last record, for a checkpoint: a resumed run's first record then averages the steps
        the straight run's does (its loss bitwise), not those since the resume alone."""
        return {"window": [dataclasses.asdict(s) for s in self.window],
                "window_seconds": time.perf_counter() - self.window_started}

    def load_state_dict(self, state: dict) -> None:
        self.window = [StepRecord(**s) for s in state.get("window", [])]  # none in checkpoints written before it
        self.window_seconds = state.get("window_seconds", 0.0)

    def begin(self, step: int) -> None:
        """Training starts after `step`: metrics.jsonl starts fresh, or, on resume, keeps the records up to the
        checkpoint's step and drops those of later steps that the interrupted run left (they are logged again). The
        trackers open: new runs, or on resume the runs of the fresh start."""
        self.first_step = step
        self.started = time.perf_counter()
        self.window_started = self.started - self.window_seconds
        if not self.is_main:
            return
        self.console = Console(self.total_steps, step, self.monitor_cfg.progress_bar)
        restart_records(self.path, step)
        self.trackers = Trackers(self.output_dir, self.monitor_cfg, self.recipe, step)

    def record(self, step: int, epoch: float, stats: StepRecord, eval_metrics: dict | None = None, force: bool = False,
               on_log=None) -> dict | None:
        """Add one optimizer step; every logging_steps, at the last step, when evaluation ran (eval_metrics) and when
        forced (a callback's should_log, a save that ranks checkpoints), the record of the window since the last
        one, which on_log(record) may edit before it is written. Then let the profiler see the step. Returns the
        record (on every rank), or None when none was due."""
        self.window.append(stats)
        self.skipped_steps += stats.skipped
        if self.console is not None:
            self.console.step(step, stats.loss, stats.lr, stats.input_tokens / max(stats.step_time, 1e-9))
        record = None
        if step % self.logging_steps == 0 or step == self.total_steps or eval_metrics or force:
            record = self._log(step, epoch, stats, eval_metrics or {}, on_log)
        self.profiler.step(step == self.total_steps)
        return record

    def evaluation(self, step: int, epoch: float, metrics: dict, on_log=None) -> dict:
        """The record of an evaluation outside a training step (train.eval_on_start: before the first one; the test
        split: after the last)."""
        record = {"step": step, "epoch": epoch, **metrics}
        if on_log is not None:
            on_log(record)
        if self.is_main:
            self._write(record)
        return record

    def _log(self, step: int, epoch: float, stats: StepRecord, eval_metrics: dict, on_log) -> dict:
        now = time.perf_counter()
        elapsed = max(now - self.window_started, 1e-9)
        steps = self.window
        input_tokens = sum(s.input_tokens for s in steps)
        tokens_per_s = input_tokens / elapsed
        tflops = self.flops_token * tokens_per_s / self.world_size / 1e12
        peak_mem, rss = memory_gib()
        record = {
            "step": step, "epoch": epoch,
            "loss": sum(s.loss for s in steps) / len(steps),
            "lr": stats.lr, "grad_norm": stats.grad_norm,
            "tokens": stats.label_tokens, "input_tokens": input_tokens,
            "tokens_per_s": tokens_per_s, f"{self.unit}_per_s": sum(s.samples for s in steps) / elapsed,
            "step_time_s": sum(s.step_time for s in steps) / len(steps),
            "data_wait_frac": sum(s.data_wait for s in steps) / elapsed,
            "tflops": tflops, "mfu": tflops / self.peak if self.peak else None,
            "mem_gib": peak_mem, "rss_gib": rss,
            "eta_s": (now - self.started) / (step - self.first_step) * (self.total_steps - step),
            "skipped_steps": self.skipped_steps,
        }
        # Averaged over the window, as the loss: over the steps that have the value (a step may lack a metric whose
        # count was 0).
        for key in dict.fromkeys(key for s in steps for key in s.features):
            values = [s.features[key] for s in steps if key in s.features]
            record[key] = sum(values) / len(values)
        if stats.loss_scale is not None:
            record["loss_scale"] = stats.loss_scale
        record.update(eval_metrics)
        if on_log is not None:
            on_log(record)
        self.window, self.window_started = [], now
        if self.is_main:
            self._write(record)
        return record

    def _write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.trackers.log(record)
        if not self.monitor_cfg.console:
            return
        evals = "".join(f" {key} {value:.4f}" for key, value in record.items()
                        if key.startswith(("eval_", "test_")) and isinstance(value, float))
        if "loss" not in record:  # an evaluation alone
            self.console.line(f"step {record['step']}/{self.total_steps}{evals}")
            return
        shown = "".join(f" {key} {record[key]:.4f}" for key in self.shown if key in record)
        self.console.line(f"step {record['step']}/{self.total_steps} epoch {record['epoch']:.2f} loss "
                          f"{record['loss']:.4f}{shown}{evals} lr {record['lr']:.3e} grad_norm {record['grad_norm']:.3f} "
                          f"tokens/s {record['tokens_per_s']:.0f} mem {record['mem_gib']:.2f} GiB skipped "
                          f"{record['skipped_steps']}")

    def end(self) -> None:
        """Training has stopped (finished, stopped or failed): the bar gives way to the lines after it, the trackers'
        runs end."""
        if self.console is not None:
            self.console.close()
            self.console = None
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None


def profiler_options(monitor_cfg, rank: int) -> dict | None:
    """torch.profiler.profile's options for this rank's trace of monitor.profile_steps [start, end] (1-based optimizer
    steps), or None where this rank traces nothing: no profile_steps, or a rank that profile_ranks leaves out."""
    steps, ranks = monitor_cfg.profile_steps, monitor_cfg.profile_ranks
    if not steps or (ranks and rank not in ranks):
        return None
    start, end = steps
    return dict(schedule=torch.profiler.schedule(wait=start - 1, warmup=0, active=end - start + 1, repeat=1),
                profile_memory=monitor_cfg.profile_memory, with_stack=monitor_cfg.with_stack,
                record_shapes=monitor_cfg.record_shapes)


class StepProfiler:
    """torch.profiler traces of the optimizer steps of monitor.profile_steps into output_dir/profile, one per rank
    (those of monitor.profile_ranks); it does nothing where profiler_options is None."""

    def __init__(self, monitor_cfg, output_dir: Path, rank: int):
        self.profiler = None
        options = profiler_options(monitor_cfg, rank)
        if options is not None:
            self.profiler = torch.profiler.profile(
                on_trace_ready=torch.profiler.tensorboard_trace_handler(str(output_dir / "profile"),
                                                                        worker_name=f"rank{rank}"),
                **options,
            )
            self.profiler.start()

    def step(self, last: bool) -> None:
        if self.profiler is None:
            return
        self.profiler.step()
        if last:
            self.profiler.stop()
