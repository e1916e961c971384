"""The profiler's options (monitor.profile_ranks, profile_memory, with_stack, record_shapes): checked with the recipe,
and passed to torch.profiler, whose trace then holds what each asks for. That only the chosen rank writes a trace on
a 2-process run: tests/dist/test_resume.py (the straight run)."""

import json

import pytest
import torch

from llmtune.config import MonitorConfig, load_config
from llmtune.errors import UserError
from llmtune.monitor.metrics import StepProfiler, profiler_options
from tests.unit.test_config import write_recipe


@pytest.mark.parametrize("monitor, world_size, expected", [
    ({"profile_ranks": [0]}, 1, "monitor.profile_ranks: traces no step without monitor.profile_steps"),
    ({"profile_steps": [1, 2], "profile_ranks": [0, -1]}, 2, "monitor.profile_ranks: [0, -1] must be ranks, 0 or more"),
    ({"profile_steps": [1, 2], "profile_ranks": [1, 2, 3]}, 2,
     "monitor.profile_ranks: [2, 3] are not ranks of this run, which has 2 (0 to 1); name ranks below 2"),
])
def test_profile_ranks_are_checked_with_the_recipe(tmp_path, monitor, world_size, expected):
    with pytest.raises(UserError) as err:
        load_config(write_recipe(tmp_path, monitor=monitor), [], "sft", world_size)
    assert expected in str(err.value)


def test_profile_ranks_choose_the_ranks_that_trace():
    every = MonitorConfig(profile_steps=[2, 3])
    assert all(profiler_options(every, rank) is not None for rank in range(4)), "default: every rank, as before"
    chosen = MonitorConfig(profile_steps=[2, 3], profile_ranks=[1, 3])
    assert [profiler_options(chosen, rank) is not None for rank in range(4)] == [False, True, False, True]
    assert profiler_options(MonitorConfig(), 0) is None, "no profile_steps: no profiler"


def test_the_window_is_steps_start_to_end():
    schedule = profiler_options(MonitorConfig(profile_steps=[2, 3]), 0)["schedule"]
    record = torch.profiler.ProfilerAction.RECORD
    # The profiler's step n (0-based) is optimizer step n + 1: steps 2 and 3 are recorded, the last one saved.
    assert [schedule(n) for n in range(4)] == [torch.profiler.ProfilerAction.NONE, record,
                                               torch.profiler.ProfilerAction.RECORD_AND_SAVE,
                                               torch.profiler.ProfilerAction.NONE]


def trace_events(monitor_cfg, folder) -> list[dict]:
    """The events of rank 0's trace of optimizer step 2 of 3 small matmul steps."""
    profiler = StepProfiler(monitor_cfg, folder, rank=0)
    for step in (1, 2, 3):
        weight = torch.randn(8, 8, requires_grad=True)
        (weight @ weight).sum().backward()
        profiler.step(step == 3)
    (trace,) = (folder / "profile").glob("rank0*.json")
    return json.loads(trace.read_text())["traceEvents"]


def what_is_recorded(events: list[dict]) -> dict[str, list[dict]]:
    """The events each option adds: operators' input shapes, Python frames, memory allocations."""
    return {"record_shapes": [e for e in events if "Input Dims" in e.get("args", {})],
            "with_stack": [e for e in events if e.get("cat") == "python_function"],
            "profile_memory": [e for e in events if e.get("name") == "[memory]"]}


def test_the_options_reach_torch_profiler(tmp_path):
    plain = what_is_recorded(trace_events(MonitorConfig(profile_steps=[2, 2]), tmp_path / "plain"))
    assert plain == {"record_shapes": [], "with_stack": [], "profile_memory": []}
    full = what_is_recorded(trace_events(MonitorConfig(profile_steps=[2, 2], profile_memory=True, with_stack=True,
                                                       record_shapes=True), tmp_path / "full"))
    assert any(e["name"] == "aten::mm" and e["args"]["Input Dims"] == [[8, 8], [8, 8]] for e in full["record_shapes"])
    assert full["with_stack"] and full["profile_memory"]
