"""Two commits' training speed measured in one run, so that the machine's drift falls on both.

    python benchmarks/compare_commits.py A B [--bench pt-fp32 pt-bf16 sft ...] [--repeats 6] [--steps 20]
                                         [--warmup 3] [--json FILE]

A and B are commits (a hash, a branch, `main`, `HEAD~3`) or a folder holding a checkout (`.` for the working tree,
uncommitted changes included). Each commit is checked out into a temporary worktree (`git worktree add --detach`,
removed at the end); nothing is installed: both run in this environment, each importing its own llmtune (its
worktree first on PYTHONPATH). Each bench is one contender of a benchmark of this folder, run by that commit's own
copy of the benchmark script (`SCRIPT --worker CONTENDER ROOT`, the interface throughput.py has had since the first
one) on a workload this tree's script prepares once: the same model, tokens and steps for both commits. Each commit
gets its own tokenized-data cache, warmed by its first repeat like any other run's.

    pt-fp32       throughput.py "llmtune fp32"       pt: the demo corpus in blocks of --seq, --batch blocks a step
    pt-bf16       throughput.py "llmtune bf16"       the same, train.bf16
    pt-compile    throughput.py "llmtune compile"    the same, train.compile (fp32)
    sft           throughput.py "llmtune defaults"   sft: skewed lengths (throughput.py --sft), packed, masked
    sft-unmasked  throughput.py "llmtune unmasked"   the same packing without document masks
    dpo           preference.py "llmtune dpo"        dpo on preference.py's pairs (commits that have it); with
                                                     --pairs-file, --tokenizer and --pair-seq, on a real file's
                                                     pairs (dpo_en_demo.json), preference.py's options

Method. A repeat runs every bench once for each commit, each run in a fresh process, the two commits back to back
(A, B, then B, A at the next repeat, so that neither always runs first); the machine's slow drift then falls on
both alike. A run's speed is its timed steps' tokens/s (dpo: pairs/s), after --warmup steps. Printed for each bench:
each commit's median over the repeats with the range of its repeats, the ratio of the medians B / A, and the range of
the per-repeat ratios (B over the A run beside it): where that range holds 1, the difference is inside the noise.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# Run as a script, this folder comes first on sys.path, where benchmarks/peft.py would stand in for the peft package
# (which transformers imports); last, it still gives throughput and preference.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE] + [str(HERE)]

import throughput  # noqa: E402

# bench -> (script in benchmarks/, contender, workload)
BENCHES = {
    "pt-fp32": ("throughput.py", "llmtune fp32", "pt"),
    "pt-bf16": ("throughput.py", "llmtune bf16", "pt"),
    "pt-compile": ("throughput.py", "llmtune compile", "pt"),
    "sft": ("throughput.py", "llmtune defaults", "sft"),
    "sft-unmasked": ("throughput.py", "llmtune unmasked", "sft"),
    "dpo": ("preference.py", "llmtune dpo", "dpo"),
}


@contextmanager
def checkout(ref: str, tmp: Path):
    """The folder of `ref`: an existing checkout as it is, else a temporary detached worktree of the commit."""
    if Path(ref).is_dir():
        yield Path(ref).resolve()
        return
    commit = subprocess.run(["git", "rev-parse", "--verify", f"{ref}^{{commit}}"], cwd=REPO, capture_output=True,
                            text=True)
    if commit.returncode:
        raise SystemExit(f"{ref!r} is neither a commit of {REPO} nor a folder: {commit.stderr.strip()}")
    folder = tmp / commit.stdout.strip()[:12]
    subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(folder), commit.stdout.strip()], cwd=REPO,
                   check=True)
    try:
        yield folder
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(folder)], cwd=REPO, check=True)


def prepare(kind: str, root: Path, args) -> None:
    """The workload of one kind of bench under root, written by this tree's benchmark (as its own main does)."""
    root.mkdir(parents=True)
    if kind == "dpo":
        import preference

        options = argparse.Namespace(pairs=128, batch=8, steps=args.steps, warmup=args.warmup, repeats=args.repeats,
                                     seq=args.pair_seq, length_scale=1.0, pairs_file=args.pairs_file,
                                     tokenizer=args.tokenizer)
        workload, _ = preference.prepare(root, options)
    else:
        options = argparse.Namespace(sft=kind == "sft", seq=512, batch=8, steps=args.steps, warmup=args.warmup,
                                     repeats=args.repeats, samples=2000, sft_seq=2048, nproc=1)
        workload = throughput.prepare(root, options)
    workload.write(root)


def commit_root(shared: Path, label: str) -> Path:
    """A root for one commit's runs: the shared workload's files, its own workload.json with its own data cache (two
    versions of llmtune never share a tokenized cache)."""
    root = shared.parent / f"{shared.name}-{label}"
    root.mkdir()
    for entry in shared.iterdir():
        if entry.name != "workload.json":
            (root / entry.name).symlink_to(entry)
    workload = json.loads((shared / "workload.json").read_text())
    workload["llmtune_data"]["cache_dir"] = str(root / "cache")
    (root / "workload.json").write_text(json.dumps(workload))
    return root


def run(tree: Path, script: str, contender: str, root: Path) -> dict:
    """One run of `contender` by `tree`'s own copy of the benchmark, in a fresh process importing `tree`'s llmtune."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
    command = [sys.executable, str(tree / "benchmarks" / script), "--worker", contender, str(root)]
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{tree}: {script} {contender!r} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    line = next(line for line in reversed(done.stdout.splitlines()) if line.startswith(throughput.RESULT))
    return json.loads(line.removeprefix(throughput.RESULT))["runners"][contender]


def speed(bench: str, result: dict) -> float:
    """tokens/s, or pairs/s for dpo, of one run's timed steps, as its benchmark counts them."""
    if BENCHES[bench][2] == "dpo":
        import preference

        return preference.speed(result)
    return throughput.speed(result)


def compare(speeds: dict[str, list[float]], labels: tuple[str, str]) -> dict:
    """One bench's figures: each commit's median and range, the ratio of the medians and the per-repeat ratios' range
    (each repeat's B over its A)."""
    a, b = (speeds[label] for label in labels)
    paired = [y / x for x, y in zip(a, b)]
    return {labels[0]: {"median": statistics.median(a), "min": min(a), "max": max(a), "runs": a},
            labels[1]: {"median": statistics.median(b), "min": min(b), "max": max(b), "runs": b},
            "ratio": statistics.median(b) / statistics.median(a), "paired_min": min(paired),
            "paired_max": max(paired)}


def print_table(table: dict[str, dict], refs: tuple[str, str], labels: tuple[str, str]) -> None:
    unit = {bench: "pairs/s" if BENCHES[bench][2] == "dpo" else "tokens/s" for bench in table}
    print(f"\nA = {refs[0]}, B = {refs[1]}; medians over the repeats [their range]")
    print(f"{'bench':14}{'A':>24}{'B':>24}{'B / A':>8}  per-repeat B / A")
    for bench, row in table.items():
        cells = [f"{row[label]['median']:,.0f} [{row[label]['min']:,.0f}-{row[label]['max']:,.0f}]"
                 for label in labels]
        inside = row["paired_min"] <= 1 <= row["paired_max"]
        print(f"{bench:14}{cells[0]:>24}{cells[1]:>24}{row['ratio']:>7.3f}x  {row['paired_min']:.3f}-"
              f"{row['paired_max']:.3f} {unit[bench]}" + ("  (within the noise)" if inside else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("a", metavar="A", help="the baseline: a commit, or a folder holding a checkout")
    parser.add_argument("b", metavar="B", help="the commit measured against A (or a folder, `.` for the working tree)")
    parser.add_argument("--bench", nargs="+", choices=list(BENCHES), default=["pt-fp32", "pt-bf16", "sft"])
    parser.add_argument("--repeats", type=int, default=6, help="runs of each bench for each commit")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="steps run before the timed ones")
    parser.add_argument("--json", type=Path, help="also write the figures and every run's speed here")
    parser.add_argument("--pairs-file", type=Path, help="dpo: preference.py --pairs-file (dpo_en_demo.json's pairs)")
    parser.add_argument("--tokenizer", type=Path, help="dpo: preference.py --tokenizer, which --pairs-file needs")
    parser.add_argument("--pair-seq", type=int, default=1024, help="dpo: preference.py --seq (a packed row's tokens)")
    args = parser.parse_args()
    if args.pairs_file and not args.tokenizer:
        parser.error("--pairs-file needs --tokenizer (preference.py's)")
    labels = ("A", "B")
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as trees:
        tmp = Path(tmp)
        folders = dict(zip(labels, (trees.enter_context(checkout(ref, tmp)) for ref in (args.a, args.b))))
        kinds = {BENCHES[bench][2] for bench in args.bench}
        for kind in sorted(kinds):
            prepare(kind, tmp / kind, args)
        roots = {(kind, label): commit_root(tmp / kind, label) for kind in kinds for label in labels}
        speeds = {bench: {label: [] for label in labels} for bench in args.bench}
        for repeat in range(args.repeats):
            order = labels if repeat % 2 == 0 else labels[::-1]
            for bench in args.bench:
                script, contender, kind = BENCHES[bench]
                for label in order:
                    result = run(folders[label], script, contender, roots[kind, label])
                    speeds[bench][label].append(speed(bench, result))
                print(f"repeat {repeat + 1}/{args.repeats} {bench}: "
                      + ", ".join(f"{label} {speeds[bench][label][-1]:,.0f}" for label in labels), flush=True)
    table = {bench: compare(speeds[bench], labels) for bench in args.bench}
    print_table(table, (args.a, args.b), labels)
    if args.json:
        args.json.write_text(json.dumps({"a": args.a, "b": args.b, "steps": args.steps, "warmup": args.warmup,
                                         "repeats": args.repeats, "benches": table}, indent=1))


if __name__ == "__main__":
    main()
