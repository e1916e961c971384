"""benchmarks/device/proof.py's reports: OUT/device_proof.json (the stages' sections as they are) and
OUT/device_proof.md (a table per part: a environment, b correctness, c speed and its profile, d memory), each written
whole."""

import json
from pathlib import Path

from llmtune.atomic import write_text

PARTS = {"a": "Environment", "b": "Correctness on CUDA", "c": "Speed", "d": "Memory"}


def write_reports(report: dict, out: Path) -> None:
    write_text(out / "device_proof.json", json.dumps(report, indent=1) + "\n")
    write_text(out / "device_proof.md", markdown(report))


def cell(value, digits: int = 2) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value).replace("|", "\\|").replace("\n", "<br>")


def table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(cell(v) for v in row) + " |" for row in rows), ""]


def stage_line(name: str, stage: dict) -> str:
    counts = ", ".join(f"{n} {status}" for status, n in stage["counts"].items()) or "no items"
    return f"`{name}` ({stage['what']}): {stage['outcome']} in {stage['seconds']:.0f} s of {stage['budget_s']} s; " \
        f"{counts}"


def environment(stages: dict) -> list[str]:
    rows = [[row["name"], row.get("value") or f"{row['status']}: {row.get('reason', '')}"]
            for row in stages["env"]["rows"]] if "env" in stages else []
    return table(["item", "value"], rows)


def correctness(stages: dict) -> list[str]:
    lines = []
    for name in ("tests", "runs"):
        if name in stages:
            lines += [stage_line(name, stages[name]), ""]
            lines += table(["item", "status", "s", "checked", "reason"],
                           [[r["name"], r["status"], r.get("seconds"), r.get("check"), r.get("reason")]
                            for r in stages[name]["rows"]])
    return lines


def speed(stages: dict) -> list[str]:
    rows = []
    for name in ("speed", "extra"):
        for r in stages.get(name, {}).get("rows", []):
            mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else None
            rows.append([r["name"], r["status"], cell(r.get("tokens_per_s"), 0), mfu, r.get("peak_gib"),
                         r.get("reason") or r.get("note")])
    lines = [stage_line(name, stages[name]) for name in ("speed", "extra") if name in stages]
    return [*lines, "", *table(["configuration", "status", "tokens/s/GPU", "MFU", "peak GiB", "reason, note"], rows)]


def profile(stages: dict) -> list[str]:
    """The profile stage's items, then its table: ms per step by category, llmtune beside the plain loop."""
    if "profile" not in stages:
        return []
    rows = stages["profile"]["rows"]
    lines = [stage_line("profile", stages["profile"]), "",
             *table(["item", "status", "s", "reason, file"], [[r["name"], r["status"], r.get("seconds"),
                                                               r.get("reason") or r.get("trace")] for r in rows])]
    compared = next((r for r in rows if "table" in r), None)
    if compared:
        lines += [f"Per profiled step, from {compared['source']}: ms, but the launches (a count).", "",
                  *table(["", "llmtune", "plain loop", "llmtune - plain loop"],
                         [[row, *values] for row, values in compared["table"].items()])]
    return lines


def memory(stages: dict) -> list[str]:
    """The plan beside every run that has both figures (the runs, speed and extra stages), then the loss cases."""
    planned = []
    for name, stage in stages.items():
        for r in stage["rows"]:
            if r.get("planned_gib") is not None:
                measured = r.get("peak_gib")
                ratio = f"{measured / r['planned_gib']:.2f}" if measured else "no CUDA" if measured is None else None
                planned.append([f"{name}: {r['name']}", cell(r["planned_gib"], 3), cell(measured, 3), ratio])
    lines = ["`llmtune plan`'s peak of a training step beside the run's torch.cuda.max_memory_allocated (above what "
             "the process held before the run):", "",
             *table(["run", "planned GiB", "measured GiB", "measured / planned"], planned)]
    if "memory" in stages:
        lines += [stage_line("memory", stages["memory"]), ""]
        lines += table(["loss", "status", "peak MiB", "time ms", "loss value", "reason"],
                       [[r["name"], r["status"], cell(r.get("peak_mib"), 0), cell(r.get("loss_ms"), 1),
                         cell(r.get("loss"), 4), r.get("reason")] for r in stages["memory"]["rows"]])
    return lines


def markdown(report: dict) -> str:
    stages = report["stages"]
    lines = ["# llmtune device proof", "",
             f"Started {report['started']}; " + ("dry run on the CPU" if report["dry_run"] else "on the GPU") +
             f"; budgets x{report['budget_scale']:g}. Written by benchmarks/device/proof.py.", ""]
    for part, renders in (("a", (environment,)), ("b", (correctness,)), ("c", (speed, profile)), ("d", (memory,))):
        lines += [f"## {part}. {PARTS[part]}", ""]
        for render in renders:
            lines += render(stages)
    return "\n".join(lines).rstrip() + "\n"
