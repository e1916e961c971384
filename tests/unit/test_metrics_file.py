"""The monitor owns metrics.jsonl: a fresh run starts it anew, a resumed run keeps the records up to its
checkpoint's step (the interrupted run's later records are logged again), and only rank 0 touches it."""

import json

from llmtune.config import MonitorConfig
from llmtune.monitor.metrics import TrainMonitor


def monitor(output_dir, rank=0) -> TrainMonitor:
    return TrainMonitor(output_dir, MonitorConfig(console=False, progress_bar=False), logging_steps=1,
                        total_steps=10, flops_token=1.0, world_size=2, rank=rank)


def steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_resume_keeps_the_records_up_to_the_checkpoint_and_a_fresh_run_starts_anew(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": step, "loss": 1.0}) + "\n" for step in range(1, 7)))
    monitor(tmp_path, rank=1).begin(0)
    assert steps(path) == [1, 2, 3, 4, 5, 6], "only rank 0 writes"
    monitor(tmp_path).begin(4)
    assert steps(path) == [1, 2, 3, 4]
    monitor(tmp_path).begin(0)
    assert not path.exists()


def test_a_record_an_interruption_cut_short_is_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": step, "loss": 1.0}) + "\n" for step in range(1, 4)) + '{"step": 4, "lo')
    monitor(tmp_path).begin(6)
    assert steps(path) == [1, 2, 3]
