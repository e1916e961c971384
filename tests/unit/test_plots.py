"""The plots of a run (plots.py): metrics.jsonl -> PNG curves in output_dir/plots, read back here as pictures of the
figure's size with the curves' colours in them; the tokens axis; a preference run's reward curves; a running run's torn last line; `llmtune plot`;
and without matplotlib, one line that says how to get it (an error for the command, a log line at a run's end)."""

import json
import logging
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image

from llmtune.errors import UserError
from llmtune.monitor.plots import DPI, FIGSIZE, cumulative_tokens, plot_run, read_records, write_plots
from llmtune.run.cli import main

NAMES = ["loss.png", "loss_tokens.png", "lr.png", "grad_norm.png", "tokens_per_s.png"]
REWARD_NAMES = ["reward_margins.png", "reward_accuracies.png"]  # a preference run's, after the loss figures
TRAIN, EVAL = (31, 119, 180), (255, 127, 14)  # matplotlib's tab:blue and tab:orange


def records(count: int = 20) -> list[dict]:
    """A run as the monitor logs it: loss going down, an evaluation every 5 steps, 5 warmup steps then linear decay."""
    logged = []
    for step in range(1, count + 1):
        record = {"step": step, "epoch": 0, "loss": 3 * math.exp(-step / 8) + 0.5 + 0.1 * (step % 3),
                  "lr": 1e-3 * min(step / 5, (count - step + 1) / (count - 4)), "grad_norm": 1 / step + 0.2,
                  "tokens": 100, "input_tokens": 1000 + step, "tokens_per_s": 5000 + 100 * (step % 4)}
        if step % 5 == 0:
            record["eval_loss"] = record["loss"] + 0.2
        logged.append(record)
    return logged


def preference_records(count: int = 20) -> list[dict]:
    """records() of a preference run: reward margins growing, accuracies from 0.5 up, and their evaluation every 5
    steps."""
    logged = records(count)
    for record in logged:
        step = record["step"]
        record.update({"rewards/margins": 0.05 * step, "rewards/accuracies": min(0.5 + 0.03 * step, 1.0),
                       "rewards/chosen": 0.02 * step, "rewards/rejected": -0.03 * step})
        if "eval_loss" in record:
            record.update({"eval_rewards/margins": 0.04 * step, "eval_rewards/accuracies": 0.5 + 0.02 * step})
    return logged


def write_metrics(folder, logged: list[dict], torn: str = ""):
    folder.mkdir(exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in logged) + torn)
    return folder


def pixels(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB")).astype(int)


def drawn(path) -> bool:
    """Not blank: text, axes and antialiased curves give hundreds of colours and spread-out values."""
    image = pixels(path)
    return len(np.unique(image @ [1 << 16, 1 << 8, 1])) > 100 and image.std() > 10


def colour(path, rgb) -> int:
    """How many pixels have (nearly) this colour."""
    return int(np.all(np.abs(pixels(path) - rgb) <= 10, axis=-1).sum())


def test_each_curve_is_a_png_of_the_figure_size_with_its_curves_drawn(tmp_path):
    run = write_metrics(tmp_path / "out", records())
    assert write_plots(run) == [run / "plots" / name for name in NAMES]
    assert sorted(p.name for p in (run / "plots").iterdir()) == sorted(NAMES), "no temporary file is left"
    for name in NAMES:
        path = run / "plots" / name
        assert Image.open(path).format == "PNG"
        assert Image.open(path).size == (round(FIGSIZE[0] * DPI), round(FIGSIZE[1] * DPI))
        assert drawn(path), name
        assert colour(path, TRAIN) > 300, f"{name}: the training curve"
        assert (colour(path, EVAL) > 300) == name.startswith("loss"), f"{name}: eval loss on the loss figures alone"
    blank = Figure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(blank).print_png(tmp_path / "blank.png")
    assert Image.open(tmp_path / "blank.png").size == Image.open(run / "plots" / "loss.png").size
    assert not drawn(tmp_path / "blank.png"), "the check tells a blank picture"


def test_a_preference_run_gets_its_reward_margins_and_accuracies_against_steps(tmp_path, monkeypatch):
    """Each reward figure holds the training curve and the evaluation's, at the steps whose records have them; the
    records of a run without them (test_each_curve_is_a_png...) get neither figure."""
    calls, plot = [], Axes.plot

    def spy(axes, x, y, **kwargs):
        calls.append((axes, kwargs["label"], list(x), list(y)))
        return plot(axes, x, y, **kwargs)

    monkeypatch.setattr(Axes, "plot", spy)
    logged = preference_records()
    run = write_metrics(tmp_path / "out", logged)
    assert write_plots(run) == [run / "plots" / name for name in (*NAMES[:2], *REWARD_NAMES, *NAMES[2:])]
    # The title, set once the curves are drawn, names the figure: "reward margins (chosen - rejected): out".
    drawn_series = {(axes.get_title().partition(":")[0], label): (x, y) for axes, label, x, y in calls}
    steps, evaluated = [r["step"] for r in logged], [r["step"] for r in logged if "eval_loss" in r]
    for title, key in (("reward margins (chosen - rejected)", "rewards/margins"),
                       ("reward accuracies", "rewards/accuracies")):
        assert drawn_series[(title, key)] == (steps, [r[key] for r in logged])
        assert drawn_series[(title, f"eval {key}")] == (evaluated, [r[f"eval_{key}"] for r in logged
                                                                    if "eval_loss" in r])
    for name in REWARD_NAMES:
        path = run / "plots" / name
        assert drawn(path) and colour(path, TRAIN) > 300 and colour(path, EVAL) > 300, name


def test_a_reward_model_run_gets_its_accuracy_and_margin_with_their_evaluation(tmp_path):
    logged = records()
    for record in logged:
        record.update({"accuracy": min(0.5 + 0.02 * record["step"], 1.0), "margin": 0.1 * record["step"]})
        if "eval_loss" in record:
            record.update({"eval_accuracy": 0.5 + 0.01 * record["step"], "eval_margin": 0.05 * record["step"]})
    run = write_metrics(tmp_path / "out", logged)
    assert [path.name for path in write_plots(run)] == [*NAMES[:2], "accuracy.png", "margin.png", *NAMES[2:]]
    for name in ("accuracy.png", "margin.png"):
        assert colour(run / "plots" / name, TRAIN) > 300 and colour(run / "plots" / name, EVAL) > 300, name


def test_reward_curves_without_an_evaluation_are_the_training_ones_alone(tmp_path):
    logged = [{k: v for k, v in record.items() if not k.startswith("eval_")} for record in preference_records()]
    run = write_metrics(tmp_path / "out", logged)
    assert [path.name for path in write_plots(run)] == [*NAMES[:2], *REWARD_NAMES, *NAMES[2:]]
    for name in REWARD_NAMES:
        assert colour(run / "plots" / name, TRAIN) > 300 and colour(run / "plots" / name, EVAL) == 0, name


def test_the_tokens_axis_is_the_input_tokens_trained_up_to_each_record():
    assert cumulative_tokens([{"input_tokens": 10}, {"input_tokens": 20}, {"input_tokens": 5}]) == [10, 30, 35]


def test_each_png_arrives_whole_by_a_rename_within_its_folder(tmp_path, monkeypatch):
    renamed, rename = [], os.replace

    def spy(source, target):
        Image.open(source).verify()  # a whole PNG before it takes its name
        renamed.append((Path(source), Path(target)))
        rename(source, target)

    monkeypatch.setattr(os, "replace", spy)
    run = write_metrics(tmp_path / "out", records())
    assert write_plots(run) == [target for _, target in renamed]
    assert all(source.parent == target.parent and source.name != target.name for source, target in renamed)


def test_a_missing_series_is_left_out_and_a_figure_with_nothing_to_draw_is_not_written(tmp_path):
    logged = [{k: v for k, v in record.items() if k != "eval_loss"} for record in records()]
    for record in logged:
        record["grad_norm"] = float("nan")  # every step skipped by the non-finite guard
    logged[3]["tokens_per_s"] = float("inf")
    run = write_metrics(tmp_path / "out", logged)
    assert [path.name for path in write_plots(run)] == ["loss.png", "loss_tokens.png", "lr.png", "tokens_per_s.png"]
    assert colour(run / "plots" / "loss.png", EVAL) == 0
    assert drawn(run / "plots" / "tokens_per_s.png"), "a non-finite point is skipped, the rest drawn"


def test_a_running_runs_torn_last_line_is_skipped_and_a_damaged_line_named(tmp_path):
    logged = records(6)
    run = write_metrics(tmp_path / "out", logged, torn=json.dumps(records(7)[-1])[:40])
    assert read_records(run) == logged
    assert len(write_plots(run)) == len(NAMES)
    write_metrics(run, [], torn='{"step": 1, "lo')
    with pytest.raises(UserError, match="metrics.jsonl holds no complete record yet; plot again once the run"):
        read_records(run)
    (run / "metrics.jsonl").write_text(json.dumps(logged[0]) + '\n{"step": 2, "lo\n' + json.dumps(logged[2]) + "\n")
    with pytest.raises(UserError, match=r"metrics.jsonl, line 2: not a JSON record \(.*\); remove that line"):
        read_records(run)


def test_llmtune_plot_lists_the_files_it_wrote_and_names_a_folder_without_metrics(tmp_path, capsys):
    run = write_metrics(tmp_path / "out", records())
    assert main(["plot", str(run)]) == 0
    assert capsys.readouterr().out.splitlines() == [str(run / "plots" / name) for name in NAMES]
    for folder in (tmp_path, tmp_path / "no_such_run"):
        assert main(["plot", str(folder)]) == 2
        assert capsys.readouterr().err == (f"llmtune: error: {folder} has no metrics.jsonl; name a run's "
                                           "train.output_dir\n")


def test_without_matplotlib_the_command_and_the_end_of_a_run_say_how_to_get_it(tmp_path, monkeypatch, capsys,
                                                                                  caplog):
    run = write_metrics(tmp_path / "out", records())
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    how = f"matplotlib is not installed; to draw the plots: pip install 'llmtune[plots]', then llmtune plot {run}"
    assert main(["plot", str(run)]) == 2
    assert capsys.readouterr().err == f"llmtune: error: {how}\n"
    caplog.set_level(logging.INFO, logger="llmtune")
    plot_run(run)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.INFO, f"plots: {how}")]
    assert not (run / "plots").exists()


def test_the_end_of_a_run_draws_the_plots_and_a_failure_to_draw_is_a_warning(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="llmtune")
    run = write_metrics(tmp_path / "out", records())
    plot_run(run)
    assert caplog.messages == [f"plots: {', '.join(NAMES)} in {run / 'plots'}"]
    caplog.clear()
    write_metrics(run, [{"loss": 2.0, "input_tokens": 10}])  # no step: no x-axis
    plot_run(run)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, f"plots: not drawn (KeyError: 'step'); draw them with: llmtune plot {run}")]
    caplog.clear()
    plot_run(tmp_path / "stopped_before_its_first_record")
    assert caplog.records == []
