"""One rank of a two-process gloo world whose last collective ends while rank 0 is exiting:
`python exit_race_worker.py RANK STORE_FILE plain|llmtune`.

Rank 0 starts an all-reduce and lets go of it; rank 1 joins it in the middle of rank 0's busy wait, whose end rank
0 publishes in the store (so that a rank slowed by a busy machine still joins within it). Gloo's worker thread on
rank 0 then lets go of the finished collective, which needs the GIL, while rank 0's main thread keeps the GIL (a
long switch interval and the busy wait) until it has begun to end. Under `plain`, rank 0 ends as a Python program
does, and an object that the interpreter's last garbage collection frees hands the GIL over during the
finalization: the worker thread is ended there and the process aborts, as the runs that aborted did. Under
`llmtune`, it ends through process_exit.run_and_exit, as every llmtune process does.
"""

import gc
import sys
import time

import torch
import torch.distributed as dist

from llmtune.run.process_exit import run_and_exit

BUSY_SECONDS = 3


class SlowToFinalize:
    """In a reference cycle, so that only a garbage collection frees it: the one of the interpreter's finalization."""

    def __init__(self):
        self.cycle = self

    def __del__(self):
        time.sleep(1)


def main(rank: int, store_file: str) -> int:
    store = dist.FileStore(store_file, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    if rank == 0:
        sys.setswitchinterval(60)
        dist.all_reduce(torch.ones(1000), async_op=True)
        until = time.monotonic() + BUSY_SECONDS
        store.set("busy_until", str(until))
        while time.monotonic() < until:
            pass
        return 0
    # CLOCK_MONOTONIC is the machine's, the same in both processes.
    time.sleep(max(float(store.get("busy_until")) - BUSY_SECONDS / 2 - time.monotonic(), 0))
    try:
        dist.all_reduce(torch.ones(1000))
    except RuntimeError:  # rank 0 may be gone already; only its exit is looked at
        pass
    return 0


if __name__ == "__main__":
    rank, store_file, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    if mode == "llmtune" and rank == 0:
        run_and_exit(lambda: main(rank, store_file))
    code = main(rank, store_file)
    if rank == 0:
        gc.collect()  # nothing collects the cycle below before the interpreter's own collection
        SlowToFinalize()
    sys.exit(code)
