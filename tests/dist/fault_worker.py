"""llmtune's CLI as a torchrun worker, with faults injected, for tests/dist/test_cluster_runs.py:

    torchrun --nproc-per-node 2 [--max-restarts 1] tests/dist/fault_worker.py FAULTS sft RECIPE [overrides ...]

FAULTS, comma-separated:
- crash@STEP: rank 1 dies (os._exit, as a killed or crashed process would) after optimizer step STEP, on torchrun's
  first attempt only, so that a restart runs clean;
- slow_build@SECONDS: local rank 0 tokenizes SECONDS longer than it takes, before it writes the cache entry;
- disk_full@STEP: rank 1's DCP shard write of the checkpoint of step STEP fails with ENOSPC, as on a full disk.
"""

import errno
import os
import sys
import time

from torch.distributed.checkpoint.filesystem import FileSystemWriter

from llmtune.run import cli
from llmtune.data import build
from llmtune.run.process_exit import run_and_exit
from llmtune.training.trainer import Trainer


def crash_after(step: int) -> None:
    advance = Trainer.advance

    def advance_then_crash(self, steps, signals):
        advance(self, steps, signals)
        if self.step == step and self.state.rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            os._exit(13)

    Trainer.advance = advance_then_crash


def slow_build(seconds: float) -> None:
    save_entry = build._save_entry

    def slow_save_entry(*args, **kwargs):
        time.sleep(seconds)
        save_entry(*args, **kwargs)

    build._save_entry = slow_save_entry


def disk_full_at(step: int) -> None:
    write_data = FileSystemWriter.write_data

    def failing_write_data(self, plan, planner):
        if f"global_step_{step}." in str(self.path) and os.environ["RANK"] == "1":
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return write_data(self, plan, planner)

    FileSystemWriter.write_data = failing_write_data


FAULTS = {"crash": lambda v: crash_after(int(v)), "slow_build": lambda v: slow_build(float(v)),
          "disk_full": lambda v: disk_full_at(int(v))}

if __name__ == "__main__":
    for fault in sys.argv[1].split(","):
        name, _, value = fault.partition("@")
        FAULTS[name](value)
    run_and_exit(lambda: cli.main(sys.argv[2:]))
