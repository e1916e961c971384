"""benchmarks/gpu.py documents every option in --help, and on a machine without CUDA says so, exits 0 and writes
nothing (it measures GPUs only)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import undocumented_options

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"


def test_help_documents_every_option():
    assert not undocumented_options(SCRIPT)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA device")
def test_without_cuda_it_says_so_and_writes_nothing(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT)], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "no CUDA device" in done.stdout
    assert list(tmp_path.iterdir()) == []
