"""On CPU, the memory a freed tensor held stays in the process for the next tensors (llmtune/run/cpu_memory.py):
resident memory does not drop when a large tensor is freed, as it does with glibc's defaults."""

import subprocess
import sys

import pytest

# Both settings in one process (one import of torch, most of its time), the default first: keep_freed_memory changes
# only what malloc does from then on.
PROBE = """
import torch
from llmtune.run.cpu_memory import keep_freed_memory

def resident_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

def freed_and_still_resident_mib():
    before = resident_mib()
    block = torch.ones(2**26)  # 256 MiB, far above glibc's largest mmap threshold
    del block
    return resident_mib() - before

by_default = freed_and_still_resident_mib()
kept = keep_freed_memory()
print(by_default, kept, freed_and_still_resident_mib())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc tunables exist on Linux only")
def test_freed_memory_stays_for_reuse_only_when_kept():
    out = subprocess.run([sys.executable, "-c", PROBE], check=True, capture_output=True, text=True).stdout
    by_default, kept, resident = out.split()
    assert kept == "True" and float(resident) > 200
    assert float(by_default) < 50
