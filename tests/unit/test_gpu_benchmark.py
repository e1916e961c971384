"""benchmarks/gpu.py documents every option in --help, and on a machine without CUDA says so, exits 0 and writes
nothing (it measures GPUs only)."""

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"


def build_parser() -> argparse.ArgumentParser:
    # benchmarks/ is a folder of scripts, not a package: the module is loaded from its file.
    spec = importlib.util.spec_from_file_location("gpu_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser()


def test_help_documents_every_option():
    options = [action for action in build_parser()._actions if not isinstance(action, argparse._HelpAction)]
    assert options
    undocumented = [action.option_strings for action in options
                    if not action.help or action.help == argparse.SUPPRESS]
    assert not undocumented
    shown = set(subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                               check=True).stdout.split())
    assert not [action.option_strings for action in options if not set(action.option_strings) & shown]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA device")
def test_without_cuda_it_says_so_and_writes_nothing(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT)], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "no CUDA device" in done.stdout
    assert list(tmp_path.iterdir()) == []
