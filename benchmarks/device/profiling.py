"""The profile stage's reading of a torch.profiler trace (the Chrome trace JSON that llmtune's monitor.profile_steps
writes, and the plain loop through the same profiler): where the profiled steps' time goes, by category, the time
the device sits idle between its kernels, the kernels launched per step; and the trace cut to one step, small enough
to come back from a lent machine.

On CUDA the work is the device's: kernels, and the copy engine's memcpy and memset, each classified by its own name,
then by the names of the host's operators it was launched in, innermost first. Without a device (the dry run) it is
the operators' self time, each classified by its own name, then its callers'. Torch-free, so that
tests/unit/test_device_profiling.py reads real names and synthetic traces without a GPU.
"""

import functools
import re
from dataclasses import dataclass
from typing import Iterable, Iterator

MATMULS, ELEMENTWISE, OTHER = "matmuls", "norms, rope, activations, other elementwise", "other"
ALL_GATHER, REDUCE_SCATTER = "FSDP all-gather", "FSDP reduce-scatter"
# (category, pattern) tried in this order on a lower-cased kernel or operator name; the first match decides. Copies
# come before the optimizer and the elementwise work: FSDP's _foreach_copy_ and the casts run in those kernels
# (multi_tensor_apply_kernel<...CopyFunctor>, vectorized_elementwise_kernel<...direct_copy_kernel_cuda>).
RULES = tuple((category, re.compile(pattern)) for category, pattern in (
    (ALL_GATHER, r"all_?gather"),
    (REDUCE_SCATTER, r"reduce_?scatter"),
    # flash-attn's and torch's flash kernels, cutlass's memory-efficient ones (fmha_cutlassB: backward), cuDNN's
    # (sdpa ... bprop), the sdpa operators and their autograd nodes
    ("attention backward", r"(flash|fmha|attn|attention|sdpa).*(bwd|backward|bprop)|fmha_cutlassb"),
    ("attention forward", r"flash|fmha|attn|attention|sdpa"),
    # transformers' loss (log_softmax, nll_loss) and llmtune's chunked one, an autograd Function of that name
    ("loss", r"cross_?entropy|log_?softmax|nll_loss|logsumexp"),
    # torch.compile's fused pointwise and reduction kernels, named after every operator they fuse, casts included
    # (triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0: an RMSNorm); its matmul templates are triton_tem_*
    (ELEMENTWISE, r"^triton_(poi|red|per)_"),
    ("copies and dtype casts", r"copy|memcpy|memset|chunk_cat|catarray|\bcast|^aten::(cat|to|clone|contiguous)$"),
    # cuBLAS (sm90_xmma_*, ampere_*gemm*, nvjet_* on CUDA 12.8 and later, its split-K reduction), cutlass, triton's
    # matmul templates (triton_tem_fused_mm_0), aten's matmul operators and their autograd nodes (MmBackward0)
    (MATMULS, r"gemm|xmma|nvjet|cublas|cutlass|matmul|linear|(^|::|_)(mm|addmm|bmm|baddbmm)(_|$|backward)"),
    ("optimizer", r"adam|multi_tensor_apply|_foreach_|optimizer"),
    (ELEMENTWISE, r"elementwise|reduce_kernel|norm|rope|rotary|silu|swiglu|gelu|softmax|triton_|fill|"
                  r"^aten::(mul|add|sub|div|pow|rsqrt|sqrt|neg|exp|log|sin|cos|silu|gelu|sigmoid|tanh|mean|sum|"
                  r"where|clamp|abs|square|reciprocal|amax|ne|eq|zero)_?(_backward)?$"),
))
CATEGORIES = (MATMULS, "attention forward", "attention backward", ELEMENTWISE, "copies and dtype casts", ALL_GATHER,
              REDUCE_SCATTER, "optimizer", "loss", OTHER)
TOTAL = "all of the above"
WAIT = "FSDP collectives' wait (no other work beside them)"
IDLE = "idle between kernels (host-bound gaps)"
SPAN = "step (first kernel's start to last one's end)"
LAUNCHES = "kernel launches (count)"
ROWS = (*CATEGORIES, TOTAL, WAIT, IDLE, SPAN, LAUNCHES)

HOST = {"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver"}  # the host's nested spans, thread by thread
LAUNCHING = {"cuda_runtime", "cuda_driver"}  # cudaLaunchKernel, cuLaunchKernel (triton), cudaMemcpyAsync...
DEVICE = {"kernel", "gpu_memcpy", "gpu_memset"}


@functools.cache
def rule(name: str) -> str | None:
    """The category the first matching rule gives the name, or None."""
    lowered = name.lower()
    return next((category for category, pattern in RULES if pattern.search(lowered)), None)


def category(names: Iterable[str]) -> str:
    """The category of one piece of work from its names: its own first, then the operators it ran in, innermost
    first. Elementwise work takes the category of the first caller that names another (the loss's softmax, the
    optimizer's arithmetic, a recomputed attention's masking), else stays elementwise; work no name places is other."""
    found = OTHER
    for name in names:
        match = rule(name)
        if match == ELEMENTWISE:
            found = ELEMENTWISE
        elif match is not None:
            return match
    return found


def merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of (start, end) intervals as disjoint intervals, in order."""
    union = []
    for start, end in sorted(intervals):
        if union and start <= union[-1][1]:
            union[-1] = (union[-1][0], max(union[-1][1], end))
        else:
            union.append((start, end))
    return union


def covered(intervals: Iterable[tuple[float, float]]) -> float:
    return sum(end - start for start, end in merged(intervals))


def idle_gaps(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The gaps between the first interval's start and the last one's end that no interval covers: on a GPU, the
    time no kernel runs on any stream, which the host's work between launches leaves."""
    union = merged(intervals)
    return [(before[1], after[0]) for before, after in zip(union, union[1:])]


def callers(events: list[dict]) -> dict[int, dict]:
    """{id(event): the host span it ran in} for the host's spans, nested by time on each thread."""
    threads: dict[tuple, list[dict]] = {}
    for event in events:
        if event.get("cat") in HOST and event.get("ph") == "X":
            threads.setdefault((event["pid"], event["tid"]), []).append(event)
    parent = {}
    for spans in threads.values():
        stack: list[dict] = []
        for span in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= span["ts"]:
                stack.pop()
            if stack:
                parent[id(span)] = stack[-1]
            stack.append(span)
    return parent


def names(event: dict | None, parent: dict[int, dict]) -> Iterator[str]:
    """The event's name, then its callers', innermost first."""
    while event is not None:
        yield event["name"]
        event = parent.get(id(event))


@dataclass(frozen=True)
class Work:
    category: str
    start: float  # µs, the trace's clock
    end: float
    spent: float  # µs counted: a kernel's duration, an operator's self time


def device_work(events: list[dict], parent: dict[int, dict]) -> list[Work]:
    """The device's kernels, memcpys and memsets, each placed by its name, then by the operators that launched it
    (its launch and the kernel share a correlation id)."""
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCHING and "correlation" in e.get("args", {})}
    return [Work(category([e["name"], *names(launches.get(e.get("args", {}).get("correlation")), parent)]), e["ts"],
                 e["ts"] + e["dur"], e["dur"]) for e in events if e.get("cat") in DEVICE]


def host_work(events: list[dict], parent: dict[int, dict]) -> list[Work]:
    """The host's operators, each with its self time (its span less the spans it called), placed by its name, then
    its callers'."""
    called: dict[int, float] = {}
    for event in events:
        caller = parent.get(id(event))
        if caller is not None:
            called[id(caller)] = called.get(id(caller), 0.0) + event["dur"]
    return [Work(category(names(e, parent)), e["ts"], e["ts"] + e["dur"], e["dur"] - called.get(id(e), 0.0))
            for e in events if e.get("cat") == "cpu_op"]


def breakdown(trace: dict, steps: int) -> dict:
    """ROWS of the trace's `steps` profiled steps, per step: ms by category (the device's kernels where the trace has
    any, else the host's operators), their sum, the collectives' wait (the time they run with no other work beside
    them: what the rest waits for), the idle gaps, the span from the first kernel to the last, and the launches."""
    events = trace["traceEvents"]
    parent = callers(events)
    device = any(e.get("cat") in DEVICE for e in events)
    work = device_work(events, parent) if device else host_work(events, parent)
    intervals = [(w.start, w.end) for w in work]
    rest = [(w.start, w.end) for w in work if w.category not in (ALL_GATHER, REDUCE_SCATTER)]
    spent = dict.fromkeys(CATEGORIES, 0.0)
    for w in work:
        spent[w.category] += w.spent
    span = max(end for _, end in intervals) - min(start for start, _ in intervals)
    gaps = sum(end - start for start, end in idle_gaps(intervals))
    launches = sum(e.get("cat") == "kernel" for e in events) if device else len(work)
    us = {**spent, TOTAL: sum(spent.values()), WAIT: covered(intervals) - covered(rest), IDLE: gaps, SPAN: span}
    return {**{row: round(value / steps / 1000, 3) for row, value in us.items()}, LAUNCHES: round(launches / steps)}


def comparison(llmtune: dict | None, plain: dict | None) -> dict:
    """{row: [llmtune, plain loop, difference]} of two breakdowns; None where a run has none."""
    def difference(row: str):
        return None if llmtune is None or plain is None else round(llmtune[row] - plain[row], 3)
    return {row: [llmtune and llmtune[row], plain and plain[row], difference(row)] for row in ROWS}


def one_step(trace: dict) -> dict:
    """The trace cut to its middle profiled step (ProfilerStep#N): the host's spans inside that step, the device work
    they launched, the processes' and threads' names. Left out, as most of the size and none of the timeline: the
    flow arrows and the host operators' arguments but their External id (which links an operator to its kernels)."""
    events = trace["traceEvents"]
    steps = sorted((e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")),
                   key=lambda e: e["ts"])
    step = steps[len(steps) // 2]
    start, end = step["ts"], step["ts"] + step["dur"]
    host = [e for e in events if e.get("cat") in HOST and start <= e["ts"] < end]
    launched = {e["args"]["correlation"] for e in host if e["cat"] in LAUNCHING and "correlation" in e.get("args", {})}
    device = [e for e in events if e.get("cat") in DEVICE and e.get("args", {}).get("correlation") in launched]
    host = [{**e, "args": {k: v for k, v in e.get("args", {}).items() if k == "External id"}}
            if e["cat"] == "cpu_op" else e for e in host]
    return {**trace, "traceEvents": [e for e in events if e.get("ph") == "M"] + host + device}
