"""Checkpoints a cluster damages (2 processes, fp32), each run against the uninterrupted run of the same recipe
(tests/dist/conftest.py's straight_run), bitwise:
- a flipped byte, a truncated shard and a missing file in the three newest checkpoints: auto with checksums skips
  each, says so and resumes from the newest good one; in the same launch, tokenizing takes longer than the
  training group's time-out (parallel.timeout_minutes) and the waiting rank does not time out;
- a full disk during a save: exit 1 with one line naming the folder, the partial folder gone, the previous
  checkpoint intact and still the one to resume from."""

import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from llmtune.checkpoint.validate import check_complete
from tests.dist.test_cluster_runs import RESUME, assert_same_run, torchrun, without_nproc
from tests.dist.test_resume import args
from tests.helpers import run_cli


@pytest.fixture(scope="module")
def runs(straight_run, tiny_model, sft_file, tmp_path_factory):
    out = {"straight": straight_run[0]}
    # The three newest checkpoints damaged, each in a file rank 1 wrote: a flipped byte, a truncated shard, a
    # missing RNG state.
    flipped = tmp_path_factory.mktemp("flipped") / "run"
    shutil.copytree(out["straight"], flipped)
    checkpoints = flipped / "checkpoints"
    data = bytearray((checkpoints / "global_step_8" / "__1_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0x01
    (checkpoints / "global_step_8" / "__1_0.distcp").write_bytes(bytes(data))
    with open(checkpoints / "global_step_6" / "__1_0.distcp", "r+b") as shard:
        shard.truncate(shard.seek(0, os.SEEK_END) - 1)
    (checkpoints / "global_step_4" / "extra_state" / "rank_1.pt").unlink()
    (flipped / "hf").rename(flipped / "hf_before")
    # A fresh data cache, built by local rank 0 in 20 s while rank 1 waits, with collectives that time out after 15 s.
    # The full-disk runs go on meanwhile, one at a time, in the time the build sleeps. Their load slows both of its
    # ranks alike, so its collectives still meet well within the 15 s.
    with ThreadPoolExecutor(1) as background:
        flipped_result = background.submit(torchrun, "slow_build@20", without_nproc(args(
            tiny_model, sft_file, flipped, 2, RESUME, "checkpoint.verify_checksums=true",
            "parallel.timeout_minutes=0.25", f"data.cache_dir={flipped / 'fresh_cache'}")))

        full = tmp_path_factory.mktemp("disk_full")
        out["full_result"] = torchrun("disk_full@4", without_nproc(args(tiny_model, sft_file, full, 2)))
        out["full_listing"] = sorted(p.name for p in (full / "checkpoints").iterdir())
        out["full_latest"] = (full / "checkpoints" / "latest").read_text()
        check_complete(full / "checkpoints" / "global_step_2", checksums=True)
        resumed = run_cli(*args(tiny_model, sft_file, full, 2, RESUME))
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        out["full"] = full

        out["flipped_result"] = flipped_result.result()
    out["flipped"] = flipped
    return out


def test_auto_skips_damaged_checkpoints_and_resumes_from_the_newest_good_one(runs):
    """Also: tokenizing took longer than the training group's time-out, and the waiting rank did not time out."""
    result = runs["flipped_result"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "data: built" in result.stderr
    skipped = [line for line in result.stderr.splitlines() if "checkpoint: skipping" in line]
    assert len(skipped) == 3, result.stderr[-3000:]
    assert "global_step_8" in skipped[0] and "__1_0.distcp does not match its checksum" in skipped[0]
    assert "global_step_6" in skipped[1] and "shard __1_0.distcp is truncated" in skipped[1]
    assert "global_step_4" in skipped[2] and "extra_state/rank_1.pt is missing" in skipped[2]
    assert "resumed from" in result.stderr and "global_step_2 at step 2" in result.stderr
    assert_same_run(runs["flipped"], runs["straight"])


def test_a_full_disk_during_a_save_stops_the_run_and_keeps_the_previous_checkpoint(runs):
    result = runs["full_result"]
    assert result.returncode == 1, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("llmtune: error: checkpoint: could not")]
    assert lines and ".global_step_4.partial" in lines[0] and "No space left on device" in lines[0]
    assert runs["full_listing"] == ["global_step_2", "latest"]
    assert runs["full_latest"] == "global_step_2"
    assert_same_run(runs["full"], runs["straight"])
