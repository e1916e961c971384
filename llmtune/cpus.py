"""The CPUs this process may run on (its affinity: a cluster's allocation or `taskset`, not the machine's count), which
bound its worker processes and its threads. Torch-free."""

import os


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
