"""The trackers of monitor.report_to, rank 0's: TensorBoard, W&B and MLflow. Each is opened when training starts,
fresh or resumed, is given the resolved recipe, gets every metrics.jsonl record under the HF Trainer's names
(train/<name>, eval/loss, test/loss) at the record's step, and is closed when training stops. A resumed run continues
the runs of its fresh start, whose ids output_dir/trackers.json keeps.

Each tracker's package is imported when it opens: none is a dependency (inputs.check_optional_packages names the
extra that installs it).
"""

import json
import os
import sys
import time
from pathlib import Path

import yaml

from llmtune.errors import Preempted

IDS_FILE = "trackers.json"


def tracker_metrics(record: dict) -> dict[str, float]:
    """A metrics.jsonl record's numbers under the HF Trainer's names: eval_loss -> eval/loss, test_loss -> test/loss,
    any other -> train/<name>. The step is the x-axis, not a metric; a null (mfu without a known peak) is left out."""
    return {tracker_name(name): value for name, value in record.items()
            if name != "step" and isinstance(value, (int, float))}


def tracker_name(name: str) -> str:
    prefix, _, rest = name.partition("_")
    return f"{prefix}/{rest}" if prefix in ("eval", "test") and rest else f"train/{name}"


def run_status() -> str:
    """How training stopped, in MLflow's words. Called in the finally of Trainer.train, where the exception on its
    way out, if any, tells: a stop by a signal (resumable) is KILLED, any other FAILED."""
    error = sys.exc_info()[1]
    if error is None:
        return "FINISHED"
    return "KILLED" if isinstance(error, (Preempted, KeyboardInterrupt)) else "FAILED"


def run_name(output_dir: Path, monitor_cfg) -> str:
    return monitor_cfg.run_name or output_dir.resolve().name


def flat_params(recipe: dict, prefix: str = "") -> dict[str, str]:
    """{"train": {"seed": 1}} -> {"train.seed": "1"}: MLflow's params are flat strings."""
    params = {}
    for key, value in recipe.items():
        if isinstance(value, dict):
            params |= flat_params(value, f"{prefix}{key}.")
        else:
            params[f"{prefix}{key}"] = str(value)
    return params


class TensorBoard:
    """Event files in output_dir/tensorboard, the run's one folder. A resumed run's writer hides the events that the
    interrupted run logged after the checkpoint (they are logged again), a fresh run's those of any earlier run in the
    folder; the recipe is text at the step training starts after."""

    def __init__(self, output_dir: Path, monitor_cfg, recipe: dict, step: int, run_id: str | None):
        from torch.utils.tensorboard import SummaryWriter

        self.run_id = None  # the folder is the run
        self.writer = SummaryWriter(str(output_dir / "tensorboard"), purge_step=step + 1 if step else 0)
        # TensorBoard renders text as markdown: a code block keeps the YAML's indentation.
        self.writer.add_text("config", f"```yaml\n{yaml.safe_dump(recipe, sort_keys=False)}```", step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self, status: str) -> None:
        self.writer.close()


class WandB:
    """A W&B run, its files in output_dir/wandb (WANDB_MODE, WANDB_API_KEY and the rest read by wandb), the recipe as
    its config; project: monitor.project, else WANDB_PROJECT, else llmtune."""

    def __init__(self, output_dir: Path, monitor_cfg, recipe: dict, step: int, run_id: str | None):
        import wandb

        self.run = wandb.init(project=monitor_cfg.project or os.environ.get("WANDB_PROJECT", "llmtune"),
                              name=run_name(output_dir, monitor_cfg), dir=str(output_dir), config=recipe,
                              id=run_id, resume="allow" if run_id else None)
        self.run_id = self.run.id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


class MLflow:
    """An MLflow run at MLFLOW_TRACKING_URI, else in a file store in output_dir/mlruns, the recipe as its params
    (dotted keys); experiment: monitor.project, else MLFLOW_EXPERIMENT_NAME, else llmtune. The params are logged
    when the run is created: MLflow refuses to change a param, which a resumed recipe may do."""

    def __init__(self, output_dir: Path, monitor_cfg, recipe: dict, step: int, run_id: str | None):
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        uri = None
        if "MLFLOW_TRACKING_URI" not in os.environ:
            # mlflow-skinny has no SQL store (mlflow 3's default, sqlite, needs SQLAlchemy), and mlflow 3 refuses a file
            # store unless this variable allows it.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (output_dir / "mlruns").resolve().as_uri()
        self.client = MlflowClient(uri)
        self.run_id = None
        if run_id:
            try:
                self.client.update_run(run_id, status="RUNNING")
                self.run_id = run_id
            except MlflowException:  # not in this store (another MLFLOW_TRACKING_URI): a new run, not a failed resume
                pass
        if self.run_id is None:
            self.run_id = self._create(monitor_cfg, run_name(output_dir, monitor_cfg), recipe)

    def _create(self, monitor_cfg, name: str, recipe: dict) -> str:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        experiment = monitor_cfg.project or os.environ.get("MLFLOW_EXPERIMENT_NAME", "llmtune")
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        # MLflow refuses a longer value; only a very long list (data files) could reach it, and config.yaml has it.
        params = [Param(key, value) for key, value in flat_params(recipe).items() if len(value) <= MAX_PARAM_VAL_LENGTH]
        for start in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(run_id, params=params[start:start + MAX_PARAMS_TAGS_PER_BATCH])
        return run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(name, value, now, step) for name, value in metrics.items()])

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status)


TRACKER_TYPES = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}


class Trackers:
    """The trackers of monitor.report_to, opened when training starts after `step` (0: a fresh run, which starts new
    tracker runs; else the checkpoint's step, and the runs in trackers.json continue), until close()."""

    def __init__(self, output_dir: Path, monitor_cfg, recipe: dict, step: int):
        path = output_dir / IDS_FILE
        ids = json.loads(path.read_text()) if step and path.is_file() else {}
        self.trackers = {name: TRACKER_TYPES[name](output_dir, monitor_cfg, recipe, step, ids.get(name))
                         for name in monitor_cfg.report_to}
        # A resumed run that leaves a tracker out keeps its id, for a later resume that names it again.
        ids |= {name: tracker.run_id for name, tracker in self.trackers.items() if tracker.run_id}
        if ids:
            partial = path.with_name(f".{IDS_FILE}.{os.getpid()}")  # the same folder: os.replace is then atomic
            partial.write_text(json.dumps(ids, indent=1) + "\n")
            os.replace(partial, path)
        else:
            path.unlink(missing_ok=True)

    def log(self, record: dict) -> None:
        metrics = tracker_metrics(record)
        for tracker in self.trackers.values():
            tracker.log(record["step"], metrics)

    def close(self) -> None:
        status = run_status()
        for tracker in self.trackers.values():
            tracker.close(status)
