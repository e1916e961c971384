"""benchmarks/device/proof.py, the GPU proof, kept working between lent GPUs: its dry run takes every stage on this
CPU with tiny shapes and writes both reports, the stages' log and the profile's trace of one step, each stage
completed, what runs here passed and what needs CUDA skipped ("no CUDA"), never passed; the profile's table from the
CPU operators' times; a stage's process that crashes inside an item is started again after it, and one out of time
keeps what it finished."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.device.profiling import CATEGORIES, LAUNCHES, ROWS
from benchmarks.device.proof import LOG, STAGES, Stage, run_stage
from benchmarks.device.stages import TRACE, TRACE_LIMIT_MIB

pytestmark = pytest.mark.slow  # the dry run trains a few tiny models and starts a process per stage

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "device" / "proof.py"
OUTCOMES = {"passed", "failed", "skipped"}
# What only a GPU runs: the rows of each stage that must be skipped here, with "no CUDA".
CUDA_ONLY = {
    "env": {"GPU", "driver (nvidia-smi)", "CUDA"},
    "runs": {"pt flash_attention_2", "pt flash_attention_3", "pt flex_attention", "sft flash_attention_2",
             "sft flash_attention_3", "sft flex_attention", "sft Liger fused kernels", "pt float8 twin (bf16)",
             "pt float8", "sft torch.compile"},
    "memory": {"loss: Liger fused linear cross-entropy"},
    "extra": {"llmtune: bf16, activation checkpointing, torch.compile",
              "llmtune: bf16, activation checkpointing, torch.compile, float8 tensorwise",
              "llmtune: bf16, activation checkpointing, torch.compile, float8 rowwise",
              "torchtitan: bf16, full activation checkpointing",
              "torchtitan: bf16, full activation checkpointing, torch.compile",
              "llmtune: bf16, selective activation checkpointing, torch.compile",
              "torchtitan: bf16, selective activation checkpointing (op), torch.compile",
              "llmtune: bf16, activation checkpointing auto, torch.compile"},
}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """(the command's result, OUT). Budgets scaled up: a busy 2-core machine must not cut a stage short."""
    out = tmp_path_factory.mktemp("proof")
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--budget-scale", "4"],
                          cwd=REPO, capture_output=True, text=True, timeout=1200)
    return done, out


@pytest.fixture(scope="module")
def report(dry_run):
    return json.loads((dry_run[1] / "device_proof.json").read_text())


def test_the_dry_run_writes_both_reports_the_log_and_the_trace_and_a_line_per_stage(dry_run):
    done, out = dry_run
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == sorted(["device_proof.md", "device_proof.json", LOG, TRACE])
    log = (out / LOG).read_text()
    assert [line.split()[2].rstrip(":") for line in log.splitlines() if line.startswith("[device_proof] stage ")] \
        == [stage.name for stage in STAGES]
    lines = done.stdout.splitlines()
    assert [line.split("`")[1] for line in lines[:-1]] == [stage.name for stage in STAGES]
    assert all(" completed in " in line for line in lines[:-1])
    assert sum(stage.budget_s for stage in STAGES) <= 8 * 60, "the whole proof in under 8 minutes"


def test_every_stage_completes_and_what_runs_on_a_cpu_passes(report):
    assert report["dry_run"] is True
    assert list(report["stages"]) == [stage.name for stage in STAGES]
    for name, stage in report["stages"].items():
        assert stage["outcome"] == "completed", name
        assert stage["rows"], name
        assert {row["status"] for row in stage["rows"]} <= OUTCOMES - {"failed"}, \
            [(row["name"], row.get("reason")) for row in stage["rows"] if row["status"] == "failed"]
    runs = {row["name"]: row for row in report["stages"]["runs"]["rows"]}
    assert {"pt sdpa", "pt eager", "sft sdpa", "sft eager", "dpo", "sft LoRA", "sft QLoRA (nf4)", "pt Qwen3-MoE",
            "sft pinned CPU offload", "sft auto micro-batch", "sft resumed bitwise", "sft export round trip",
            "pt control: sdpa, document mask off"} <= {name for name, row in runs.items() if row["status"] == "passed"}
    assert "within" in runs["pt eager"]["check"] and "bitwise" in runs["sft resumed bitwise"]["check"]
    speed = report["stages"]["speed"]["rows"]
    assert [row["status"] for row in speed] == ["passed", "passed"]
    assert all(row["tokens_per_s"] > 0 for row in speed)


def test_the_profile_gives_the_table_of_both_runs_from_cpu_operators_and_llmtunes_step_as_a_trace(dry_run, report):
    rows = {row["name"]: row for row in report["stages"]["profile"]["rows"]}
    assert all(row["status"] == "passed" for row in rows.values()), rows
    table = rows["llmtune against the plain loop"]["table"]
    assert list(table) == list(ROWS) and rows["llmtune against the plain loop"]["source"].startswith("CPU")
    for llmtune, plain, difference in table.values():
        assert difference == pytest.approx(llmtune - plain, abs=1e-3)
    for name in ("llmtune: time by category", "plain FSDP2 loop: time by category"):
        breakdown = rows[name]["breakdown"]
        assert breakdown["matmuls"] > 0 and breakdown["attention forward"] > 0 and breakdown["optimizer"] > 0
        assert breakdown[LAUNCHES] > 0
        assert sum(breakdown[c] for c in CATEGORIES) == pytest.approx(breakdown["all of the above"], abs=0.01)
    trace = json.loads((dry_run[1] / TRACE).read_text())
    assert [e["name"] for e in trace["traceEvents"] if e["name"].startswith("ProfilerStep#")] == ["ProfilerStep#2"]
    assert rows["llmtune: one step's Chrome trace"]["trace_mib"] < TRACE_LIMIT_MIB
    assert "| matmuls | " in (dry_run[1] / "device_proof.md").read_text()


def test_what_needs_cuda_is_reported_skipped_for_want_of_it(report):
    stages = report["stages"]
    for name, expected in CUDA_ONLY.items():
        rows = {row["name"]: row for row in stages[name]["rows"]}
        assert expected <= set(rows), name
        for row in map(rows.get, expected):
            assert row["status"] == "skipped" and row["reason"].startswith("no CUDA"), row
    tests = stages["tests"]["rows"]
    assert {row["name"].split("::")[1] for row in tests} >= {
        "test_flash_attention_on_packed_rows_equals_every_document_alone_on_cuda",
        "test_a_swapped_layer_computes_in_float8[cuda-tensorwise]",
        "test_the_fused_loss_alone_in_evaluation_with_lm_head_alone_trained_and_without_labels"}
    assert all(row["status"] == "skipped" and row["reason"].startswith("no CUDA: ") for row in tests)
    planned = [row for stage in stages.values() for row in stage["rows"] if "planned_gib" in row]
    assert len(planned) >= 10 and all(row["planned_gib"] > 0 and row["peak_gib"] is None for row in planned), \
        "the plan is made for every run; on a CPU no allocator's peak stands beside it"


def test_the_markdown_has_a_table_per_part_naming_every_item(dry_run, report):
    text = (dry_run[1] / "device_proof.md").read_text()
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings == ["## a. Environment", "## b. Correctness on CUDA", "## c. Speed", "## d. Memory"]
    for stage in report["stages"].values():
        for row in stage["rows"]:
            assert f"| {row['name']} |" in text
    assert "| runs: sft sdpa | " in text and "| no CUDA |" in text


def test_a_stage_crashed_in_an_item_goes_on_after_it_and_one_out_of_time_keeps_what_it_finished(tmp_path):
    """A stand-in stage: item a passes, b ends its process, lost meets a CUDA error that leaves the process's CUDA
    unusable (its process ends, the next item runs in a new one), c outlasts the budget."""
    script = tmp_path / "stage.py"
    script.write_text(f"""import os, sys, time
from pathlib import Path
sys.path.insert(0, {str(REPO)!r})
from benchmarks.device.items import Results
results = Results(Path({str(tmp_path / "fake.jsonl")!r}))
results.run("a", lambda: {{"value": 1}})
results.run("b", lambda: os._exit(3))
results.run("before", lambda: {{"pid": os.getpid()}})
def lost():
    raise RuntimeError("CUDA error: an illegal memory access was encountered")
results.run("lost", lost)
results.run("after", lambda: {{"pid": os.getpid()}})
results.run("c", lambda: time.sleep(60))
""")
    section = run_stage(Stage("fake", "b", 3, "a stand-in"), [sys.executable, str(script)], 3, tmp_path,
                        tmp_path / "fake.log")
    assert section["outcome"] == "timed out"
    rows = {row["name"]: row for row in section["rows"]}
    assert rows["a"]["status"] == "passed" and rows["a"]["value"] == 1
    assert rows["b"]["status"] == "failed" and "ended (exit 3) during it" in rows["b"]["reason"]
    assert rows["lost"]["status"] == "failed" and "illegal memory access" in rows["lost"]["reason"]
    assert rows["after"]["status"] == "passed" and rows["after"]["pid"] != rows["before"]["pid"]
    assert rows["c"]["status"] == "timed out"
    assert section["counts"] == {"passed": 3, "failed": 2, "timed out": 1}
    assert "started again" in (tmp_path / "fake.log").read_text()
