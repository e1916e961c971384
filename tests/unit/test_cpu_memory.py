"""On CPU, the memory a freed tensor held stays in the process for the next tensors (llmtune/run/cpu_memory.py):
resident memory does not drop when a large tensor is freed, as it does with glibc's defaults."""

import subprocess
import sys

import pytest

PROBE = """
import sys
import torch
from llmtune.run.cpu_memory import keep_freed_memory

def resident_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

kept = keep_freed_memory() if sys.argv[1] == "keep" else None
before = resident_mib()
block = torch.ones(2**26)  # 256 MiB, far above glibc's largest mmap threshold
del block
print(kept, resident_mib() - before)
"""


def freed_and_still_resident_mib(mode: str) -> tuple[str, float]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], check=True, capture_output=True, text=True).stdout
    kept, mib = out.split()
    return kept, float(mib)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc tunables exist on Linux only")
def test_freed_memory_stays_for_reuse_only_when_kept():
    kept, resident = freed_and_still_resident_mib("keep")
    assert kept == "True" and resident > 200
    _, resident = freed_and_still_resident_mib("default")
    assert resident < 50
