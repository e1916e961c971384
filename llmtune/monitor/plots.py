"""A run's curves as PNG files: metrics.jsonl -> output_dir/plots/ (loss and eval loss against steps and against
tokens, a preference run's reward margins and accuracies, a grpo run's reward, a reward model's accuracy and
margin, learning rate, grad norm, tokens/s),
drawn by rank 0 when a run ends and by `llmtune plot` for a finished or running run. matplotlib is an optional extra
(llmtune[plots]), imported only to draw, and used through its object-oriented API on the Agg canvas: no GUI, and no
pyplot state or backend switch in the process that calls."""

import itertools
import json
import logging
import math
import os
from pathlib import Path

from llmtune.command import command_line
from llmtune.errors import UserError

log = logging.getLogger("llmtune")

FIGSIZE, DPI = (6.4, 4.8), 100  # inches and dots per inch: 640 x 480 pixels
MARKED_POINTS = 50  # up to this many points a curve marks each one (a single point is otherwise invisible)


def read_records(output_dir: Path) -> list[dict]:
    """The records of output_dir/metrics.jsonl. A last line without its newline is a record a running run is still
    writing: skipped when it is not yet whole JSON."""
    path = output_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{output_dir} has no metrics.jsonl; name a run's train.output_dir")
    lines = path.read_text().split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number < len(lines):
                raise UserError(f"{path}, line {number}: not a JSON record ({err}); remove that line") from None
    if not records:
        raise UserError(f"{path} holds no complete record yet; plot again once the run has logged a step")
    return records


def cumulative_tokens(records: list[dict]) -> list[int]:
    """The input tokens trained up to each record: a record's input_tokens are its logging window's, the steps since
    the record before it."""
    return list(itertools.accumulate(record.get("input_tokens", 0) for record in records))  # 0: an evaluation alone


def smoothed(values: list[float]) -> list[float]:
    """LLaMA-Factory's plot_loss smoothing: an exponential moving average whose weight grows with the number of
    points (0.4 for 20, 0.89 for 100, at most 0.9), so that a short run's curve stays close to its points."""
    weight = 1.8 * (1 / (1 + math.exp(-0.05 * len(values))) - 0.5)
    averages, last = [], values[0]
    for value in values:
        last = last * weight + (1 - weight) * value
        averages.append(last)
    return averages


def points(records: list[dict], xs: list[float], key: str) -> tuple[list[float], list[float]]:
    """(x, y) of the records that hold a finite `key` (evaluation records alone hold eval_loss; a skipped step's
    grad norm may be NaN)."""
    pairs = [(x, record[key]) for x, record in zip(xs, records)
             if isinstance(record.get(key), (int, float)) and math.isfinite(record[key])]
    return [x for x, _ in pairs], [y for _, y in pairs]


def write_plots(output_dir: Path) -> list[Path]:
    """output_dir's metrics.jsonl -> output_dir/plots/*.png, each written under a temporary name then renamed, so that
    a viewer never opens half a file; a figure with nothing to draw is not written. Returns the paths written.
    UserError: no metrics.jsonl, no whole record in it, or no matplotlib (the message says how to get it)."""
    records = read_records(output_dir)
    try:
        import matplotlib.style
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import EngFormatter, MaxNLocator
    except ImportError:
        raise UserError(f"matplotlib is not installed; to draw the plots: pip install 'llmtune[plots]', then "
                        f"{command_line('plot', output_dir)}") from None
    steps = [record["step"] for record in records]
    tokens = cumulative_tokens(records)
    folder = output_dir / "plots"
    folder.mkdir(exist_ok=True)
    written = []
    for name, title, xs, x_label, keys in [
        ("loss", "loss", steps, "step", ("loss", "eval_loss")),
        ("loss_tokens", "loss", tokens, "input tokens trained", ("loss", "eval_loss")),
        # A preference task's metrics (TRL's names, tasks/dpo.py and tasks/kto.py), which other tasks' records lack.
        ("reward_margins", "reward margins (chosen - rejected)", steps, "step",
         ("rewards/margins", "eval_rewards/margins")),
        ("reward_accuracies", "reward accuracies", steps, "step", ("rewards/accuracies", "eval_rewards/accuracies")),
        # grpo's reward of its completions (TRL's name, tasks/grpo.py).
        ("reward", "reward (mean over the step's completions)", steps, "step", ("reward",)),
        # A reward model's (TRL's RewardTrainer's names, tasks/reward.py).
        ("accuracy", "accuracy (the chosen response scored higher)", steps, "step", ("accuracy", "eval_accuracy")),
        ("margin", "margin (chosen score - rejected score)", steps, "step", ("margin", "eval_margin")),
        ("lr", "learning rate", steps, "step", ("lr",)),
        ("grad_norm", "grad norm", steps, "step", ("grad_norm",)),
        ("tokens_per_s", "tokens/s (input)", steps, "step", ("tokens_per_s",)),
    ]:
        series = {key: xy for key in keys if (xy := points(records, xs, key))[0]}
        if not series:
            continue
        # The default style, whatever the user's matplotlibrc says: the same pictures, of FIGSIZE x DPI pixels.
        with matplotlib.style.context("default"):
            figure = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
            FigureCanvasAgg(figure)
            axes = figure.subplots()
            for key, (x, y) in series.items():
                marker = "o" if len(x) <= MARKED_POINTS else None
                if key == "loss" and len(x) > 1:
                    axes.plot(x, y, color="tab:blue", alpha=0.4, marker=marker, markersize=3, label="loss")
                    axes.plot(x, smoothed(y), color="tab:blue", label="loss, smoothed")
                else:
                    axes.plot(x, y, color="tab:orange" if key.startswith("eval_") else "tab:blue", marker=marker,
                              markersize=3, label=key.replace("_", " "))
            axes.set(title=f"{title}: {output_dir.resolve().name}", xlabel=x_label)
            if xs is tokens:
                axes.xaxis.set_major_formatter(EngFormatter())
            else:
                axes.xaxis.set_major_locator(MaxNLocator(integer=True))
            axes.grid(alpha=0.3)
            if len(axes.lines) > 1:
                axes.legend()
            path = folder / f"{name}.png"
            temporary = folder / f".{name}.{os.getpid()}.png"  # the same folder: os.replace is then atomic
            figure.savefig(temporary, format="png", dpi=DPI)
        os.replace(temporary, path)
        written.append(path)
    return written


def plot_run(output_dir: Path) -> None:
    """The end of a run, on rank 0, however it ended: its curves drawn, or one line that says why not. Never raises:
    a failure to draw is a warning, and the run's own outcome and error stay what they were."""
    if not (output_dir / "metrics.jsonl").is_file():
        return  # the run stopped before its first record: nothing to draw
    try:
        written = write_plots(output_dir)
    except UserError as err:  # no matplotlib, or no whole record yet
        log.info("plots: %s", err)
    except Exception as err:
        log.warning("plots: not drawn (%s: %s); draw them with: %s", type(err).__name__, err,
                    command_line("plot", output_dir))
    else:
        log.info("plots: %s in %s", ", ".join(path.name for path in written), output_dir / "plots")
