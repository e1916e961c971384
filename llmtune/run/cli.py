"""argv -> command. The recipe is checked here, its Hub ids fetched and every path it names checked, before torch
is imported; then, against the model's config, the enabled features' checks and the model's own (built on the meta
device): all before any process or process group starts. Under torchrun, where every process runs this, a recipe
that names Hub ids is fetched and checked in the worker once the process group exists, so that one process per
node fetches while the others wait."""

import argparse
import os
import shlex
import sys

from llmtune import __version__
from llmtune.errors import Preempted, TrainingStopped, UserError
from llmtune.llamafactory import STAGES
from llmtune.tasks.registry import TASKS

NAMES = "|".join(TASKS)
USAGE = f"""llmtune {NAMES} RECIPE [--key VALUE ...] [section.key=VALUE ...] [--nproc N]
               [--resume_from_checkpoint PATH|auto]
       llmtune train FLAT_RECIPE [...]    a LLaMA-Factory recipe: the task is its stage
       llmtune data RECIPE [--n N] [--task {NAMES}] [section.key=value ...]
       llmtune export CHECKPOINT_DIR OUT_DIR [--dtype bf16|fp32] [--overwrite] [--merge] [--verify]
       llmtune generate MODEL_DIR (--prompt TEXT | --file JSONL --out JSONL [--nproc N] | --chat)
               [--max_new_tokens N] [--do_sample true|false] [--temperature T] [--seed S] [...]
       llmtune score MODEL_DIR FILE [--out JSONL] [--batch N]
       llmtune plot OUTPUT_DIR
       llmtune plan RECIPE [--nproc N | --nnodes M --nproc-per-node N] [--device-memory GiB] [--task {NAMES}]
               [section.key=VALUE ...]
       llmtune demo [--nproc N] [section.key=VALUE ...]
       llmtune {NAMES} --help    every recipe key, its default and its meaning"""
# What `llmtune COMMAND --help` says for the commands that take no recipe keys of their own (export and plot have
# argparse's, the tasks list every recipe key).
COMMAND_HELP = {
    "data": "The first N training samples as the model sees them (the rendered text, the trained tokens marked) and "
            "the data's statistics, on one process.",
    "plan": "What a training step holds per rank (weights, gradients, optimizer state, activations) on this layout "
            "and device, with no process started and no weight read.",
    "demo": "Generates data, a tokenizer and a tiny Llama under runs/demo, then pre-trains, fine-tunes, aligns it and "
            "trains it online (pt, sft, dpo, grpo), printing held-out accuracy; run it again to go on after a Ctrl-C.",
    "train": "Trains a LLaMA-Factory recipe (flat, as its examples/ are: no sections) as llmtune STAGE FLAT_RECIPE "
             f"does, the task its stage ({', '.join(STAGES)}; sft where it names none), its keys read under "
             "llmtune's names or refused with the reason (docs/from-other-trainers.md). Every key, its default and "
             "meaning: llmtune STAGE --help, or llmtune train FLAT_RECIPE --help for the recipe's own stage.",
}
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command ended by Ctrl-C


def train_command(task: str, recipe: str, rest: list[str]) -> int:
    from llmtune.config import load_config, parse_overrides
    from llmtune.run import launch
    from llmtune.run.preflight import checked_inputs

    overrides, nproc = parse_overrides(rest, task)
    if nproc and launch.launched_by_torchrun():
        raise UserError("--nproc cannot be used inside torchrun; torchrun already started the processes")
    world_size = nproc or launch.world_size_from_env()
    config = load_config(recipe, overrides, task, world_size)
    local, decided = checked_inputs(config, world_size)  # decides the auto settings
    if nproc and nproc > 1:
        from llmtune.run.micro_batch import launch_env

        # The workers train with the settings decided here, before they start.
        return launch.launch_local(nproc, [task, recipe, *overrides], launch_env(decided))
    from llmtune.run.worker import run

    run(config, local, resume_command(task, recipe, overrides, config.train.overwrite_output_dir))
    return 0


def resume_command(task: str, recipe: str, overrides: list[str], overwrites: bool) -> str:
    """The command line that continues this run from its newest good checkpoint. overwrites: the run's
    train.overwrite_output_dir, which would refuse to go on from its checkpoints: the command turns it off."""
    from llmtune.command import command_line
    from llmtune.run import launch

    kept = [o for o in overrides
            if not o.startswith(("checkpoint.resume_from_checkpoint=", "train.overwrite_output_dir="))]
    words = [task, recipe, *kept, *(["train.overwrite_output_dir=false"] if overwrites else []),
             "checkpoint.resume_from_checkpoint=auto"]
    if launch.local_nproc():
        return command_line(*words, "--nproc", launch.local_nproc())
    if launch.launched_by_torchrun():
        per_node = os.environ.get("LOCAL_WORLD_SIZE")
        if os.environ.get("GROUP_WORLD_SIZE") == "1" and per_node:  # one node (torchrun sets both)
            return shlex.join(["torchrun", "--standalone", f"--nproc-per-node={per_node}", "-m", "llmtune", *words])
        return "on every node, the launch that started this run, with: -m llmtune " + shlex.join(words)
    return command_line(*words)


def take_flag(args: list[str], flag: str, default: str) -> str:
    """The value of `flag VALUE` or `flag=VALUE` in args (default when absent), removed from args, so that what
    is left holds the recipe overrides alone."""
    for i, token in enumerate(args):
        if token == flag:
            if i + 1 >= len(args):
                raise UserError(f"{flag} needs a value")
            value = args[i + 1]
            del args[i:i + 2]
            return value
        if token.startswith(f"{flag}="):
            del args[i]
            return token.partition("=")[2]
    return default


def check_task(task: str) -> None:
    if task not in TASKS:
        raise UserError(f"--task: {task!r} is not a task; use one of {', '.join(TASKS)}")


def data_command(args: list[str]) -> int:
    """RECIPE, --n, --task and overrides -> the first N training samples and the data statistics, on one process."""
    from llmtune.config import default_task, parse_overrides

    recipe, rest = args[0], list(args[1:])
    count, task = take_flag(rest, "--n", "3"), take_flag(rest, "--task", default_task(recipe))
    check_task(task)
    overrides, nproc = parse_overrides(rest, task)
    if nproc:
        raise UserError("--nproc: llmtune data runs on one process and starts none; remove --nproc")
    if not count.isdigit() or int(count) < 1:
        raise UserError(f"--n: {count!r} is not a positive number of samples")
    from llmtune.config import load_config
    from llmtune.run.inputs import check_inputs, fetch_hub_inputs, local_inputs

    config = load_config(recipe, overrides, task, world_size=1, task_flag=True)
    # Imported after the checks above: datasets and transformers take seconds to import.
    from llmtune.data.preview import check_previewable, preview
    from llmtune.monitor.console import configure_logging

    check_previewable(config)
    local = local_inputs(config, fetch_hub_inputs(config))
    check_inputs(local)
    # The run's logging setup (worker.py), so that the cache entry's "data: built" or "data: cache hit" shows.
    configure_logging()
    if config.has_auto():  # the padded batches' efficiency counts its micro-batches
        from llmtune.model.build import load_model_config
        from llmtune.run.micro_batch import decide_before_start

        decide_before_start(config, local, load_model_config(local.model, local.head()), 1)
    preview(task, local, int(count))
    return 0


def export_command(args: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="llmtune export", description="DCP checkpoint -> HF folder, offline, one "
                                                                        "process")
    parser.add_argument("checkpoint")
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", help="bf16 or fp32; default: the run's checkpoint.export_dtype")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    parser.add_argument("--merge", action="store_true", help="a run that trained adapters: write the HF folder with "
                                                            "them merged, not the adapter folder")
    parser.add_argument("--verify", action="store_true", help="check every checkpoint file against the checksum "
                                                             "written with it (reads the checkpoint once more)")
    parsed = parser.parse_args(args)
    from pathlib import Path

    from llmtune.checkpoint.folders import check_checkpoint_folder

    check_checkpoint_folder(Path(parsed.checkpoint))  # a wrong folder refused before torch's import (seconds)
    from llmtune.run.export import export_checkpoint

    print(export_checkpoint(Path(parsed.checkpoint), Path(parsed.out_dir), parsed.dtype, parsed.overwrite,
                            parsed.merge, parsed.verify))
    return 0


def bounded(kind, least: float, most: float | None = None, above: bool = False):
    """An argparse type: a number of `kind` from `least` (above it, with `above`) to `most`, refused with the bound
    it breaks, as the recipe's eval_generation keys are."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if value < least or (above and value == least):
            raise argparse.ArgumentTypeError(f"{text} must be {'above' if above else 'at least'} {least}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"{text} must be at most {most}")
        return value
    return parse


def true_or_false(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"{text!r} is neither true nor false")
    return text.lower() == "true"


def generate_parser() -> argparse.ArgumentParser:
    # No abbreviated flags: --nproc is taken out of the command line by its exact spelling for the workers.
    parser = argparse.ArgumentParser(prog="llmtune generate", allow_abbrev=False, description=(
        "Completions of a HF model folder (a run's output_dir/hf) through the engine that generates during "
        "training: each completion is drawn by its own generator, seeded from --seed and its prompt's and sample's "
        "index, so that it is the same on any number of processes. The sampling flags left out take the folder's "
        "generation_config.json, else transformers' defaults (max_new_tokens: 256, TRL's)."))
    parser.add_argument("model_dir", metavar="MODEL_DIR",
                        help="a HF model folder (config.json, weights, tokenizer); for a run that trained adapters, "
                             "its merged export")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", metavar="TEXT",
                        help="one text prompt (tokenized as it is, no chat template); each completion printed")
    source.add_argument("--file", metavar="JSONL",
                        help="a JSONL file of prompts: a 'prompt' column, a string or a list of messages (TRL's "
                             "prompt-only forms; messages rendered with the chat template and its generation "
                             "prompt); needs --out")
    source.add_argument("--chat", action="store_true",
                        help="a conversation on the terminal: each line read is a user turn, the reply printed; an "
                             "empty line, exit or the end of input ends it")
    parser.add_argument("--image", metavar="PATH", action="append",
                        help="with --prompt, a vision-language model's image (repeat for several): the prompt is then "
                             "a user turn of the chat template, the images before its text unless it marks their "
                             "places with <image>; --file's rows give theirs in an 'images' column")
    parser.add_argument("--out", metavar="JSONL",
                        help="--file's rows, each with a 'completion' column (a string, or the assistant's message "
                             "for a messages prompt; a 'completion' the file has is replaced); with "
                             "--num_return_sequences n, n rows per prompt row, one after another (transformers' "
                             "order: the first prompt's n, then the second's). Written whole or not at all")
    parser.add_argument("--nproc", metavar="N", type=bounded(int, 1),
                        help="split --file over N local processes (torchrun), each with the whole model; the same "
                             "file as one process")
    parser.add_argument("--max_new_tokens", metavar="N", type=bounded(int, 1),
                        help="the most tokens of a completion")
    parser.add_argument("--do_sample", metavar="true|false", type=true_or_false,
                        help="true: sample; false: the likeliest token")
    parser.add_argument("--temperature", metavar="T", type=bounded(float, 0),
                        help="sampling temperature; 0: greedy decoding, as --do_sample false")
    parser.add_argument("--top_p", metavar="P", type=bounded(float, 0, 1), help="nucleus sampling's probability mass")
    parser.add_argument("--top_k", metavar="K", type=bounded(int, 0),
                        help="sample among the k likeliest tokens; 0: all")
    parser.add_argument("--min_p", metavar="P", type=bounded(float, 0, 1),
                        help="drop tokens below min_p x the likeliest's probability")
    parser.add_argument("--repetition_penalty", metavar="R", type=bounded(float, 0, above=True),
                        help="transformers' repetition penalty")
    parser.add_argument("--num_return_sequences", metavar="N", type=bounded(int, 1),
                        help="completions per prompt (needs sampling)")
    parser.add_argument("--seed", metavar="S", type=int, default=0,
                        help="seeds every completion's generator (default 0)")
    parser.add_argument("--batch_size", metavar="N", type=bounded(int, 1),
                        help="completions decoded together on a process (default 64)")
    return parser


def check_model_folder(model_dir: str, use: str) -> None:
    """A HF model folder's refusals that need no torch; `use`: what the command does with it ("generate from")."""
    from pathlib import Path

    model = Path(model_dir)
    if not model.is_dir():
        raise UserError(f"{model}: no such folder; give a HF model folder, a run's output_dir/hf or an llmtune "
                        "export folder")
    if (model / "adapter_config.json").is_file():
        raise UserError(f"{model}: an adapter folder; {use} the merged HF folder: output_dir/hf of a run "
                        "with checkpoint.export_merged: true, or llmtune export CHECKPOINT OUT --merge")
    if not (model / "config.json").is_file():
        raise UserError(f"{model}: not a HF model folder (no config.json); give a run's output_dir/hf or an "
                        "llmtune export folder")


def check_out(out: str) -> None:
    """--out names a file that can be written in a folder that exists."""
    from pathlib import Path

    if Path(out).is_dir():
        raise UserError(f"--out: {out} is a folder; give a file path")
    if not Path(out).parent.is_dir():
        raise UserError(f"--out: {out} is in a folder that does not exist; create it or give another path")


def check_generate_flags(parsed: argparse.Namespace) -> None:
    """The refusals that need no model, before torch is imported; each names its flag or path and the fix."""
    from pathlib import Path

    from llmtune.run.launch import launched_by_torchrun

    check_model_folder(parsed.model_dir, "generate from")
    if parsed.file and not parsed.out:
        raise UserError("--file: the completions go to a JSONL file; add --out OUT.jsonl")
    if parsed.out and not parsed.file:
        raise UserError("--out: writes the completions of --file; give --file PROMPTS.jsonl or leave --out out")
    if parsed.file and not Path(parsed.file).is_file():
        raise UserError(f"--file: {parsed.file} is not a file")
    if parsed.out:
        check_out(parsed.out)
    if not parsed.file and (parsed.nproc or launched_by_torchrun()):
        raise UserError("--nproc: only --file's prompts are split over processes; run --prompt and --chat on one "
                        "process, without --nproc or torchrun")
    if parsed.nproc and launched_by_torchrun():
        raise UserError("--nproc cannot be used inside torchrun; torchrun already started the processes")
    if parsed.temperature == 0 and parsed.do_sample:
        raise UserError("--temperature 0 is greedy decoding (as --do_sample false); leave out --do_sample true, or "
                        "sample at a temperature above 0")
    if parsed.image and not parsed.prompt:
        raise UserError("--image: the images of --prompt; --file's rows give theirs in an 'images' column")
    for image in parsed.image or ():
        if not Path(image).is_file():
            raise UserError(f"--image: {image} is not a file")
    if parsed.chat and (parsed.num_return_sequences or 1) > 1:
        raise UserError("--num_return_sequences: --chat goes on with one reply per turn; leave it out")


def generate_command(args: list[str]) -> int:
    """MODEL_DIR and the flags -> the completions printed, or written to --out, or a chat; --nproc N starts N
    workers through torchrun, this command line less --nproc, which share the prompts."""
    parsed = generate_parser().parse_args(args)
    check_generate_flags(parsed)
    from llmtune.generation.prompts import read_prompt_rows

    # Read before torch is imported (seconds): an empty file, or a row that is no prompt, refused at once.
    rows = read_prompt_rows(parsed.file) if parsed.file else []
    from llmtune.run import generate

    if parsed.nproc and parsed.nproc > 1:
        from llmtune.run.launch import launch_local

        generate.checked_inputs(parsed, rows)  # refused here once, not by every worker
        workers = list(args)
        take_flag(workers, "--nproc", "")
        return launch_local(parsed.nproc, ["generate", *workers])
    generate.run(parsed, rows)
    return 0


def score_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmtune score", allow_abbrev=False, description=(
        "Scores of a reward model's folder (a sequence classifier of one label: an llmtune rm run's output_dir/hf) "
        "for each row of a JSONL file, each prompt + completion rendered as llmtune rm trains on a pair's sequence: "
        "strings without a chat template (the prompt with the tokenizer's special tokens, the completion with EOS), "
        "messages with the folder's chat template. Every row is checked before the weights load; fp32, on CUDA "
        "when there is one, else the CPU."))
    parser.add_argument("model_dir", metavar="MODEL_DIR",
                        help="a reward model's HF folder (config.json, weights, tokenizer); for a run that trained "
                             "adapters, its merged export")
    parser.add_argument("file", metavar="FILE",
                        help="a JSONL file, TRL's forms: 'prompt' and 'completion' (both strings, or both lists of "
                             "messages), or 'messages', a conversation whose last turn, the assistant's, is scored; "
                             "'tools' beside messages")
    parser.add_argument("--image", metavar="PATH", action="append",
                        help="with --prompt, a vision-language model's image (repeat for several): the prompt is then "
                             "a user turn of the chat template, the images before its text unless it marks their "
                             "places with <image>; --file's rows give theirs in an 'images' column")
    parser.add_argument("--out", metavar="JSONL",
                        help="write FILE's rows, each with a 'score' column (one the row has is replaced), whole or "
                             "not at all; without it the scores are printed, one a line, in FILE's order")
    parser.add_argument("--batch", metavar="N", type=bounded(int, 1),
                        help="sequences scored together (default 16)")
    return parser


def score_command(args: list[str]) -> int:
    """MODEL_DIR FILE and the flags -> each row's score printed, or the rows written to --out with theirs."""
    from pathlib import Path

    parsed = score_parser().parse_args(args)
    check_model_folder(parsed.model_dir, "score with")
    if not Path(parsed.file).is_file():
        raise UserError(f"FILE: {parsed.file} is not a file; give a JSONL file of prompts and completions")
    if parsed.out:
        check_out(parsed.out)
    from llmtune.run import score

    score.run(parsed)
    return 0


def plan_command(args: list[str]) -> int:
    """RECIPE, the layout and the device's memory -> what a training step holds per rank, on this machine, with no
    process started and no weight read."""
    from llmtune.config import default_task, parse_overrides

    recipe, rest = args[0], list(args[1:])
    task = take_flag(rest, "--task", default_task(recipe))
    nnodes, per_node = take_flag(rest, "--nnodes", ""), take_flag(rest, "--nproc-per-node", "")
    memory = take_flag(rest, "--device-memory", "")
    check_task(task)
    overrides, nproc = parse_overrides(rest, task)
    if nproc and (nnodes or per_node):
        raise UserError("llmtune plan: give --nproc N (one node) or --nnodes M --nproc-per-node N, not both")
    for flag, value in (("--nnodes", nnodes), ("--nproc-per-node", per_node)):
        if value and (not value.isdigit() or int(value) < 1):
            raise UserError(f"{flag}: {value!r} is not a positive number")
    try:
        device_gib = float(memory) if memory else None
    except ValueError:
        device_gib = -1.0
    if device_gib is not None and device_gib <= 0:
        raise UserError(f"--device-memory: {memory!r} is not a positive number of GiB (e.g. 80 for an H100 80GB)")
    world_size = nproc or int(nnodes or 1) * int(per_node or 1)
    from llmtune.config import load_config
    from llmtune.run.inputs import fetched_config

    config = load_config(recipe, overrides, task, world_size, task_flag=True)
    model = fetched_config(config.model)  # before torch's import (seconds): a missing id refused at once
    from llmtune.run.plan import plan_recipe

    print(plan_recipe(config, model, world_size, device_gib, nproc or int(per_node or 1)))
    return 0


def plot_command(args: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="llmtune plot", description="a run's metrics.jsonl -> PNG curves in "
                                     "OUTPUT_DIR/plots (loss and eval loss against steps and tokens, a preference "
                                     "run's reward margins and accuracies, learning rate, grad norm, tokens/s), for a "
                                     "finished or a running run")
    parser.add_argument("output_dir", help="the run's train.output_dir")
    parsed = parser.parse_args(args)
    from pathlib import Path

    from llmtune.monitor.plots import write_plots

    for path in write_plots(Path(parsed.output_dir)):
        print(path)
    return 0


def usage_of(command: str) -> str:
    """The usage entry of `command` in USAGE, its continuation lines included (a task's under its own name)."""
    name, entry = NAMES if command in TASKS else command, []
    for line in USAGE.splitlines():
        words = line.split()
        if entry and not words[0].startswith("["):
            break
        if entry or (words[1] == name and words[2] != "--help"):
            entry.append(line)
    first = entry[0].strip().replace(f"llmtune {NAMES} ", f"llmtune {command} ")
    return "\n".join([f"usage: {first}", *entry[1:]])


def command_help(command: str, args: list[str]) -> str:
    """`llmtune COMMAND --help`: a task's (every recipe key), or a command's of COMMAND_HELP; train's, given a flat
    recipe, goes on with the help of the task its stage names."""
    if command in TASKS:
        from llmtune.config import recipe_help

        return f"{usage_of(command)}\n\n{TASKS[command].description}\n\n{recipe_help(command)}"
    shown = f"{usage_of(command)}\n\n{COMMAND_HELP[command]}"
    if command == "train" and (recipe := next((arg for arg in args if not arg.startswith("-")), None)):
        from llmtune.config import flat_recipe_task

        task = flat_recipe_task(recipe)
        shown += f"\n\n{recipe}: stage {task}, trained as llmtune {task} trains it:\n\n{command_help(task, [])}"
    return shown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmtune", usage=USAGE,
                                     description="FSDP2 training of HF causal LMs: " + ", ".join(TASKS) + ".")
    parser.add_argument("--version", action="version", version=f"llmtune {__version__}")
    parser.add_argument("command", choices=[*TASKS, "train", "data", "export", "generate", "score", "demo", "plot",
                                            "plan"])
    parser.add_argument("args", nargs=argparse.REMAINDER)
    parsed = parser.parse_args(argv)
    try:
        if (parsed.command in TASKS or parsed.command in COMMAND_HELP) and {"-h", "--help"} & set(parsed.args):
            print(command_help(parsed.command, parsed.args))
            return 0
        if parsed.command == "export":
            return export_command(parsed.args)
        if parsed.command == "generate":
            return generate_command(parsed.args)
        if parsed.command == "score":
            return score_command(parsed.args)
        if parsed.command == "plot":
            return plot_command(parsed.args)
        if parsed.command == "demo":
            from llmtune.demo.run import main as demo_main

            return demo_main(parsed.args)
        if not parsed.args or parsed.args[0].startswith("-"):
            raise UserError(f"{parsed.command} needs a recipe: llmtune {parsed.command} RECIPE.yaml")
        if parsed.command == "data":
            return data_command(parsed.args)
        if parsed.command == "plan":
            return plan_command(parsed.args)
        if parsed.command == "train":
            from llmtune.config import flat_recipe_task

            return train_command(flat_recipe_task(parsed.args[0]), parsed.args[0], parsed.args[1:])
        return train_command(parsed.command, parsed.args[0], parsed.args[1:])
    except UserError as err:
        print(f"llmtune: error: {err}", file=sys.stderr)
        return err.exit_code
    except (TrainingStopped, Preempted) as err:
        # Every rank stops with the same message (the reasons are agreed over ranks): rank 0 says it.
        from llmtune.run.launch import rank_from_env

        if rank_from_env() == 0:
            print(f"llmtune: {'error: ' if isinstance(err, TrainingStopped) else ''}{err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        # Ctrl-C where train.save_on_signals does not catch it (before training starts, or when it lists no SIGINT):
        # what was being written (the data cache, a checkpoint, the export) goes under a temporary name, so nothing is
        # left half-written under its own.
        from llmtune.run.launch import rank_from_env

        if rank_from_env() == 0:
            print("llmtune: interrupted (Ctrl-C)", file=sys.stderr)
        return INTERRUPTED


def entry_point() -> None:
    """The `llmtune` command and `python -m llmtune`: main(), then the process ends as process_exit says."""
    from llmtune.run.process_exit import run_and_exit

    run_and_exit(main)
