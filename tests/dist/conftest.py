"""The run that test_resume.py and test_cluster_runs.py both compare with, made once for the two files."""

import pytest

from tests.dist.test_resume import args
from tests.helpers import run_cli


@pytest.fixture(scope="session")
def straight_run(tiny_model, sft_file, tmp_path_factory):
    """(output_dir, the CompletedProcess) of the uninterrupted 2-process run of test_resume's recipe, which every
    resumed, restarted or repaired run must match. A launch costs ~10 s, mostly imports, hence one for both files.
    Shared: no test may change it; one that damages checkpoints damages a copy. Its rank 1 alone traces step 2 with
    the operators' shapes (test_resume.py checks the trace; the numbers do not change)."""
    output_dir = tmp_path_factory.mktemp("straight")
    result = run_cli(*args(tiny_model, sft_file, output_dir, 2, "monitor.profile_steps=[2,2]",
                           "monitor.profile_ranks=[1]", "monitor.record_shapes=true"))
    assert result.returncode == 0, result.stderr[-3000:]
    return output_dir, result
