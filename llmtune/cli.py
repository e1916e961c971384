"""argv -> command. The recipe and every path it names are checked here, before torch is imported
and before any process or process group starts."""

import argparse
import sys

from llmtune.errors import TrainingStopped, UserError

USAGE = """llmtune pt|sft RECIPE [section.key=value ...] [--section.key VALUE ...] [--nproc N]
       llmtune demo [--workdir DIR]"""


def parse_overrides(tokens: list[str]) -> tuple[list[str], int | None]:
    """`a.b=c`, `--a.b=c` and `--a.b c` -> ["a.b=c", ...]; plus the value of --nproc."""
    overrides, nproc, i = [], None, 0
    while i < len(tokens):
        token = tokens[i]
        name = token[2:] if token.startswith("--") else token
        if token.startswith("--") and "=" not in name:
            if i + 1 >= len(tokens):
                raise UserError(f"{token} needs a value")
            name, i = f"{name}={tokens[i + 1]}", i + 1
        key, _, value = name.partition("=")
        if key == "nproc":
            if not value.isdigit() or int(value) < 1:
                raise UserError(f"--nproc: {value!r} is not a positive number of processes")
            nproc = int(value)
        elif "=" in name:
            overrides.append(name)
        else:
            raise UserError(f"unexpected argument {token!r}; overrides are written section.key=value")
        i += 1
    return overrides, nproc


def train_command(task: str, recipe: str, rest: list[str]) -> int:
    from llmtune import launch
    from llmtune.config import load_config
    from llmtune.inputs import check_inputs

    overrides, nproc = parse_overrides(rest)
    if nproc and launch.launched_by_torchrun():
        raise UserError("--nproc cannot be used inside torchrun; torchrun already started the processes")
    config = load_config(recipe, overrides, task, nproc or launch.world_size_from_env())
    check_inputs(config)
    if nproc and nproc > 1:
        return launch.launch_local(nproc, [task, recipe, *overrides])
    from llmtune.worker import run

    run(config)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmtune", usage=USAGE,
                                     description="FSDP2 pre-training (pt) and supervised fine-tuning (sft) of HF causal LMs.")
    parser.add_argument("command", choices=["pt", "sft", "demo"])
    parser.add_argument("args", nargs=argparse.REMAINDER)
    parsed = parser.parse_args(argv)
    try:
        if parsed.command == "demo":
            from llmtune.demo.run import main as demo_main

            return demo_main(parsed.args)
        if not parsed.args or parsed.args[0].startswith("-"):
            raise UserError(f"{parsed.command} needs a recipe: llmtune {parsed.command} RECIPE.yaml")
        return train_command(parsed.command, parsed.args[0], parsed.args[1:])
    except (UserError, TrainingStopped) as err:
        print(f"llmtune: error: {err}", file=sys.stderr)
        return err.exit_code
