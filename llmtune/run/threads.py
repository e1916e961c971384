"""The threads of torch's intra-op pool in each process, as torchrun would choose them for several ranks: the cores the
process may run on divided by the node's ranks, unless the user set OMP_NUM_THREADS.

Why not torch's default: it is the machine's cores in every process, whatever the process's affinity (a cluster's
allocation of 8 CPUs on a 128-core node) and however many ranks share them. Threads that outnumber the free cores
wait for each other at the end of every parallel operation: on a loaded 2-core machine the demo's pre-training ran
at 108-1,367 tokens/s with 2 threads in one process against 4,500-19,400 with one thread a rank; here, with both
cores busy, 5,500 against 9,100 (one thread); idle, 2 threads run it at 22,000 against 14,000."""

import os

import psutil

from llmtune.cpus import usable_cpus

THREADS = "OMP_NUM_THREADS"
# Set beside OMP_NUM_THREADS by a launcher of llmtune's own (launch_local, the demo) that chose the threads of the
# processes it starts: why it chose them, for their banners, which so tell its choice from the user's.
CHOSEN = "LLMTUNE_THREADS_CHOSEN"


def usable_cores() -> int:
    """The cores of the CPUs this process may run on, a core's hyperthreads counted once (by the machine's ratio
    of cores to logical CPUs): torch's default takes the machine's cores, whatever the process's affinity."""
    logical = psutil.cpu_count() or 1
    return max(1, usable_cpus() * (psutil.cpu_count(logical=False) or logical) // logical)


def threads_for(processes: int) -> int:
    """The threads of each of `processes` processes sharing this process's cores."""
    return max(1, usable_cores() // processes)


def launch_env(processes: int, why: str = "") -> dict[str, str]:
    """The variables that give each of the `processes` processes started from this one threads_for's threads (why:
    the banner's reason, default the division); none where OMP_NUM_THREADS is set (its value then reaches every
    process: the user's, or an outer launcher's choice)."""
    if THREADS in os.environ:
        return {}
    why = why or f"{usable_cores()} cores this process may use / {processes} local ranks"
    return {THREADS: str(threads_for(processes)), CHOSEN: why}


def set_threads() -> str:
    """Set this process's intra-op threads where neither the user nor llmtune's launcher did; returns how many and
    why, for the start banner."""
    import torch  # here alone: the launchers that choose their processes' threads import no torch

    if THREADS in os.environ:  # torch has read it
        return f"{torch.get_num_threads()} per process ({os.environ.get(CHOSEN) or f'{THREADS}={os.environ[THREADS]}'})"
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    torch.set_num_threads(threads_for(local_ranks))
    return (f"{torch.get_num_threads()} per process ({usable_cores()} cores this process may use / {local_ranks} "
            f"local rank{'s' if local_ranks > 1 else ''}; {THREADS} sets them)")
