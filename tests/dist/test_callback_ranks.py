"""Callbacks on 2 processes: what one rank's callback asks or raises acts on every rank at the same step, with no
hang: a stop asked by rank 1 alone ends both ranks after that step (saved and exported as a run's end); a callback
raising on rank 1 alone stops both with its name and message, exit 1, the last checkpoint kept."""

from tests.helpers import read_metrics, run_cli


def launch(tiny_model, sft_file, output_dir, callback: str):
    return run_cli("sft", "recipes/demo/sft.yaml", f"model.name_or_path={tiny_model}", f"data.train_files={sft_file}",
                   f"train.output_dir={output_dir}", "eval_generation.files=[]", "train.max_steps=6", "train.logging_steps=1",
                   "train.per_device_train_batch_size=4", "train.global_batch_size=16", "checkpoint.save_steps=2",
                   f"train.callbacks=[tests.dist.callback_cases:{callback}]", "--nproc", "2", timeout=300)


def test_one_ranks_stop_stops_every_rank_at_the_same_step(tiny_model, sft_file, tmp_path):
    result = launch(tiny_model, sft_file, tmp_path, "StopOnRankOne")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "global_step_2"
    assert (tmp_path / "hf" / "config.json").is_file()
    assert "training stopped at step 2 of 6: a callback set control.should_training_stop" in result.stderr


def test_a_callback_raising_on_one_rank_stops_every_rank_with_its_message(tiny_model, sft_file, tmp_path):
    result = launch(tiny_model, sft_file, tmp_path, "RaiseOnRankOne")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "callback RaiseOnRankOne raised in on_step_end: RuntimeError: rank 1 gives up" in result.stderr
    assert (tmp_path / "checkpoints" / "latest").read_text() == "global_step_2"
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2], "both stopped at step 3, before its record"
    assert not (tmp_path / "hf").exists()
