"""A real run with every tracker, offline, through the worker: 4 steps saving at step 2, then the same recipe resumed
from that checkpoint. The trackers get metrics.jsonl's numbers and the recipe the worker resolved, and the resumed
run continues the same tracker runs."""

import json

import pytest
import yaml

from llmtune.config import load_config
from llmtune.monitor.trackers import flat_params
from llmtune.run.worker import run
from tests.helpers import offline_trackers, read_metrics


@pytest.fixture(scope="module")
def runs(tiny_model, sft_file, tmp_path_factory):
    """(output_dir, trackers.json and config.yaml of the first run)."""
    root = tmp_path_factory.mktemp("tracker_runs")
    out = root / "out"
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(tiny_model)},
        "data": {"train_files": [str(sft_file)], "chat_template": "basic", "max_seq_len": 64},
        "train": {"output_dir": str(out), "max_steps": 4, "per_device_train_batch_size": 2, "logging_steps": 1},
        "checkpoint": {"save_steps": 2},
        "monitor": {"report_to": ["tensorboard", "wandb", "mlflow"], "plots": False},
    }))
    with pytest.MonkeyPatch.context() as patch:
        offline_trackers(patch, root)
        run(load_config(str(recipe), [], "sft", world_size=1))
        first_ids, first_recipe = json.loads((out / "trackers.json").read_text()), read_recipe(out)
        resume = f"checkpoint.resume_from_checkpoint={out / 'checkpoints' / 'global_step_2'}"
        run(load_config(str(recipe), [resume], "sft", world_size=1))
        yield out, first_ids, first_recipe


def read_recipe(out) -> dict:
    return {"task": "sft", **yaml.safe_load((out / "config.yaml").read_text())}


def mlflow_run(out):
    from mlflow.tracking import MlflowClient

    client = MlflowClient((out / "mlruns").as_uri())
    [found] = client.search_runs([client.get_experiment_by_name("llmtune").experiment_id])
    return client, found


def test_the_trackers_get_the_records_numbers_and_the_resolved_recipe(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _, first_recipe = runs
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    board = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    board.Reload()
    assert [(e.step, e.value) for e in board.Scalars("train/loss")] == [
        (r["step"], pytest.approx(r["loss"])) for r in records], "steps 3 and 4 once: the first run's are hidden"
    texts = [event.tensor_proto.string_val[0].decode() for event in board.Tensors("config/text_summary")]
    assert [yaml.safe_load(text.removeprefix("```yaml\n").removesuffix("```")) for text in texts] == [
        first_recipe, read_recipe(out)], "each start's recipe (the resumed run's names its checkpoint)"
    client, found = mlflow_run(out)
    assert found.data.params == flat_params(first_recipe), "every key; MLflow keeps a run's params"
    assert [(m.step, m.value) for m in client.get_metric_history(found.info.run_id, "train/grad_norm")][-2:] == [
        (r["step"], r["grad_norm"]) for r in records[-2:]]


def test_a_resumed_run_continues_the_same_tracker_runs(runs):
    out, first_ids, _ = runs
    assert json.loads((out / "trackers.json").read_text()) == first_ids and first_ids.keys() == {"wandb", "mlflow"}
    client, found = mlflow_run(out)
    assert (found.info.run_id, found.info.run_name, found.info.status) == (first_ids["mlflow"], "out", "FINISHED")
    assert sorted(m.step for m in client.get_metric_history(found.info.run_id, "train/loss")) == [1, 2, 3, 3, 4, 4]
    # W&B names an offline run's folder offline-run-<time>-<run id>: both starts wrote to the same run.
    assert [path.name.split("-")[3] for path in sorted((out / "wandb").glob("offline-run-*"))] == [
        first_ids["wandb"]] * 2
