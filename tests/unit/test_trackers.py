"""The trackers, driven through TrainMonitor as Trainer.train drives it and read back offline: TensorBoard's event
files (EventAccumulator), W&B's offline run files (its transaction log, record by record), MLflow's file store
(MlflowClient). One run is stopped by a signal after step 5 and resumed from its checkpoint at step 3; another is
started afresh twice in the same folder, the second time failing."""

import json
import struct
import time

import pytest
import yaml

from llmtune.config import TRACKERS, MonitorConfig
from llmtune.errors import Preempted
from llmtune.monitor.metrics import StepRecord, TrainMonitor
from llmtune.monitor.trackers import TRACKER_TYPES, tracker_metrics
from tests.helpers import offline_trackers

# The data file's name makes a param longer than MLflow takes (6000 characters); the 150 options more params than
# one MLflow call takes (100).
RECIPE = {"task": "sft", "train": {"learning_rate": 0.001, "max_steps": 6},
          "data": {"train_files": ["x" * 6000 + ".jsonl"], "chat_template": "basic"},
          "peft": {f"option_{i}": i for i in range(150)}}


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """Every test here offline (tests.helpers.offline_trackers)."""
    with pytest.MonkeyPatch.context() as patch:
        offline_trackers(patch, tmp_path_factory.mktemp("wandb_home"))
        yield


def train(output_dir, first: int, last: int, loss, evals: dict, stop: Exception | None = None,
          report_to=TRACKERS) -> None:
    """Steps first+1..last, each logged, as Trainer.train drives the monitor; `stop` raised after the last."""
    monitor_cfg = MonitorConfig(report_to=list(report_to), run_name="first-try", console=False, progress_bar=False)
    monitor = TrainMonitor(output_dir, monitor_cfg, logging_steps=1, total_steps=6, flops_token=1.0, world_size=1,
                           rank=0, recipe=RECIPE)
    monitor.begin(first)
    try:
        for step in range(first + 1, last + 1):
            stats = StepRecord(loss=loss(step), lr=1e-3, grad_norm=0.5, label_tokens=100, input_tokens=120,
                               samples=4, step_time=0.01, data_wait=0.0, skipped=False)
            monitor.record(step, 0, stats, {"eval_loss": evals[step]} if step in evals else None)
        if stop is not None:
            raise stop
    finally:
        monitor.end()


def mlflow_client(output_dir):
    from mlflow.tracking import MlflowClient

    return MlflowClient((output_dir / "mlruns").as_uri())


def tracker_ids(output_dir) -> dict:
    return json.loads((output_dir / "trackers.json").read_text())


@pytest.fixture(scope="module")
def resumed(offline, tmp_path_factory):
    """(output_dir, trackers.json and the MLflow run's status after the stop): losses 10/step, stopped by a signal
    after step 5; then resumed at step 3 with losses 20/step (what the tracker shows tells the two apart)."""
    out = tmp_path_factory.mktemp("resumed")
    with pytest.raises(Preempted):
        train(out, 0, 5, lambda step: 10 / step, {3: 2.5}, Preempted("stopped by SIGTERM after step 5"))
    stopped = tracker_ids(out), mlflow_client(out).get_run(tracker_ids(out)["mlflow"]).info.status
    train(out, 3, 6, lambda step: 20 / step, {6: 1.5})
    return out, *stopped


@pytest.fixture(scope="module")
def restarted(offline, tmp_path_factory):
    """(output_dir, trackers.json of the first run): a fresh run of 2 steps, then another fresh run in the same
    folder (losses 30/step) that fails after its first step."""
    out = tmp_path_factory.mktemp("restarted")
    train(out, 0, 2, lambda step: 10 / step, {})
    first = tracker_ids(out)
    with pytest.raises(RuntimeError):
        train(out, 0, 1, lambda step: 30 / step, {}, RuntimeError("the data loader died"))
    return out, first


def test_every_tracker_the_recipe_accepts_has_a_type():
    assert set(TRACKER_TYPES) == set(TRACKERS)


def test_metric_names_are_the_hf_trainers_and_nulls_are_left_out():
    record = {"step": 3, "epoch": 0, "loss": 1.5, "mfu": None, "aux_loss": 0.1, "eval_loss": 2.0}
    assert tracker_metrics(record) == {"train/epoch": 0, "train/loss": 1.5, "train/aux_loss": 0.1, "eval/loss": 2.0}
    assert tracker_metrics({"step": 4, "epoch": 1.0, "test_loss": 1.8}) == {"train/epoch": 1.0, "test/loss": 1.8}


def scalars(accumulator, tag) -> list[tuple[int, float]]:
    return [(event.step, pytest.approx(event.value)) for event in accumulator.Scalars(tag)]


def tensorboard(output_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(output_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def test_tensorboard_scalars_under_hf_names_the_recipe_as_text_and_the_resumed_steps_replaced(resumed):
    out, _, _ = resumed
    board = tensorboard(out)
    # Steps 4 and 5 of the stopped run are hidden: the resumed run logged them again.
    assert scalars(board, "train/loss") == [(1, 10.0), (2, 5.0), (3, 10 / 3), (4, 5.0), (5, 4.0), (6, 20 / 6)]
    assert scalars(board, "eval/loss") == [(3, 2.5), (6, 1.5)]
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s", "train/epoch"} <= set(board.Tags()["scalars"])
    assert not {"loss", "eval_loss", "step", "train/step", "train/eval_loss"} & set(board.Tags()["scalars"])
    assert "train/mfu" not in board.Tags()["scalars"], "mfu is null on CPU: left out"
    texts = board.Tensors("config/text_summary")
    assert [event.step for event in texts] == [0, 3], "the recipe at each start, fresh and resumed"
    assert texts[1].tensor_proto.string_val[0].decode() == f"```yaml\n{yaml.safe_dump(RECIPE, sort_keys=False)}```"


def test_tensorboard_fresh_run_hides_an_earlier_runs_events(restarted):
    out, _ = restarted
    assert scalars(tensorboard(out), "train/loss") == [(1, 30.0)]


def wandb_runs(output_dir) -> list[dict]:
    """Each W&B offline run under output_dir/wandb, in the order they started: its run record, history rows
    ({name: value}, the step under _step) and exit code. wandb's service writes a run's file on its own and may still
    be writing it after finish() returns (a loaded machine left one empty): read again until every run has its exit
    record, for up to a minute."""
    deadline = time.monotonic() + 60
    while True:
        runs = [wandb_run(path) for path in (output_dir / "wandb").glob("offline-run-*/run-*.wandb")]
        if all("exit_code" in run for run in runs) or time.monotonic() > deadline:
            return sorted(runs, key=lambda run: run["run"].start_time.ToNanoseconds())
        time.sleep(0.1)


def wandb_run(path) -> dict:
    """One run's records, from its transaction log: LevelDB's log format, a 7-byte header, then 32 KiB blocks of
    chunks (CRC, length, type: full, first, middle, last), each record a wandb_internal Record."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, position, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    run = {"history": []}
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:  # a block's tail too short for a chunk header is padding
            position += 32768 - position % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record, pending = Record.FromString(pending), b""
            if record.HasField("run"):
                run["run"] = record.run
            elif record.HasField("history"):
                items = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
                run["history"].append({key: json.loads(value) for key, value in items.items()
                                       if key != "_timestamp"})
            elif record.HasField("exit"):
                run["exit_code"] = record.exit.exit_code
    return run


def history(run, name) -> list[tuple[int, float]]:
    return [(row["_step"], pytest.approx(row[name])) for row in run["history"] if name in row]


def test_wandb_logs_hf_names_by_step_with_the_recipe_as_config_and_a_resumed_run_continues_it(resumed):
    out, ids, _ = resumed
    stopped, continued = wandb_runs(out)
    assert stopped["run"].run_id == continued["run"].run_id == ids["wandb"] == tracker_ids(out)["wandb"]
    assert (stopped["run"].resume, continued["run"].resume) == (False, True)
    assert stopped["run"].display_name == "first-try" and stopped["run"].project == "llmtune"
    config = {item.key: json.loads(item.value_json) for item in stopped["run"].config.update}
    assert {key: config[key] for key in RECIPE} == RECIPE
    assert history(stopped, "train/loss") == [(step, 10 / step) for step in range(1, 6)]
    assert history(stopped, "eval/loss") == [(3, 2.5)]
    assert history(continued, "train/loss") == [(step, 20 / step) for step in range(4, 7)]
    assert history(continued, "eval/loss") == [(6, 1.5)]
    names = set().union(*stopped["history"])
    assert "train/lr" in names and not {"loss", "step", "train/step", "eval_loss", "train/mfu"} & names
    assert (stopped["exit_code"], continued["exit_code"]) == (1, 0)


def test_wandb_fresh_run_in_the_same_folder_is_a_new_run(restarted):
    out, first = restarted
    earlier, fresh = wandb_runs(out)
    assert earlier["run"].run_id == first["wandb"] != fresh["run"].run_id == tracker_ids(out)["wandb"]
    assert not fresh["run"].resume
    assert history(fresh, "train/loss") == [(1, 30.0)]


def metric_history(client, run_id, name) -> list[tuple[int, float]]:
    return sorted((metric.step, metric.value) for metric in client.get_metric_history(run_id, name))


def test_mlflow_logs_hf_names_by_step_with_the_recipe_as_params_and_a_resumed_run_continues_it(resumed):
    out, ids, status_when_stopped = resumed
    client = mlflow_client(out)
    [run] = client.search_runs([client.get_experiment_by_name("llmtune").experiment_id])
    assert run.info.run_id == ids["mlflow"] == tracker_ids(out)["mlflow"]
    assert run.info.run_name == "first-try"
    assert (status_when_stopped, run.info.status) == ("KILLED", "FINISHED")
    assert {key: run.data.params[key] for key in ("task", "train.learning_rate", "train.max_steps",
                                                  "data.chat_template")} == {
        "task": "sft", "train.learning_rate": "0.001", "train.max_steps": "6", "data.chat_template": "basic"}
    assert "data.train_files" not in run.data.params, "longer than MLflow takes: left out"
    assert {f"peft.option_{i}" for i in range(150)} <= run.data.params.keys()
    # MLflow keeps every point: the stopped run's steps 4 and 5 stay beside the resumed run's.
    assert metric_history(client, run.info.run_id, "train/loss") == sorted(
        [(step, 10 / step) for step in range(1, 6)] + [(step, 20 / step) for step in range(4, 7)])
    assert metric_history(client, run.info.run_id, "eval/loss") == [(3, 2.5), (6, 1.5)]
    assert not {"loss", "step", "train/step", "eval_loss", "train/mfu"} & run.data.metrics.keys()


def test_mlflow_fresh_run_in_the_same_folder_is_a_new_run_and_a_failure_is_failed(restarted):
    out, first = restarted
    client = mlflow_client(out)
    fresh_id = tracker_ids(out)["mlflow"]
    assert fresh_id != first["mlflow"]
    assert client.get_run(first["mlflow"]).info.status == "FINISHED"
    assert client.get_run(fresh_id).info.status == "FAILED"
    assert metric_history(client, fresh_id, "train/loss") == [(1, 30.0)]


def test_a_fresh_run_without_trackers_forgets_the_ids(tmp_path):
    (tmp_path / "trackers.json").write_text('{"wandb": "old-run"}\n')
    TrainMonitor(tmp_path, MonitorConfig(console=False, progress_bar=False), logging_steps=1, total_steps=1,
                 flops_token=1.0, world_size=1, rank=0).begin(0)
    assert not (tmp_path / "trackers.json").exists(), "a later resume naming wandb must not continue an old run"


def test_mlflow_logs_to_mlflow_tracking_uri_in_mlflow_experiment_name_when_set(offline, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    store = tmp_path / "elsewhere"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the user's to set for a store of their own
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    out = tmp_path / "out"
    out.mkdir()
    train(out, 0, 1, lambda step: 1.0, {}, report_to=["mlflow"])
    assert not (out / "mlruns").exists()
    client = MlflowClient(store.as_uri())
    [found] = client.search_runs([client.get_experiment_by_name("from-env").experiment_id])
    assert found.info.run_id == tracker_ids(out)["mlflow"]


def test_mlflow_resume_with_a_run_the_store_lacks_starts_a_new_run(offline, tmp_path):
    tmp_path.joinpath("trackers.json").write_text('{"mlflow": "0123456789abcdef0123456789abcdef"}')
    train(tmp_path, 3, 4, lambda step: 1.0, {}, report_to=["mlflow"])
    run_id = tracker_ids(tmp_path)["mlflow"]
    assert run_id != "0123456789abcdef0123456789abcdef"
    assert metric_history(mlflow_client(tmp_path), run_id, "train/loss") == [(4, 1.0)]
