"""The paragraph that ends a run says what it left: why there is no checkpoint (saving off, or a run that ended
before its first save), and the dtype of the exported weights (checkpoint.export_dtype, bf16 also for an fp32 run)."""

from pathlib import Path

import pytest

from llmtune.config import CheckpointConfig
from llmtune.run.summary import RunResult, run_summary


def result(export: Path | None) -> RunResult:
    return RunResult(Path("out"), steps=3, total_steps=10, tokens=1000, loss=1.5, eval_loss=None, best_eval_loss=None,
                     test_loss=None, metrics={}, eval_metrics={}, checkpoint=None, export=export, adapter=None)


@pytest.mark.parametrize("saving, said", [({}, "no checkpoint saved (checkpoint.save_steps or save_epochs turn "
                                               "saving on)"),
                                          ({"save_steps": 5}, "no checkpoint saved (the run ended before its first "
                                                              "save)")])
def test_no_checkpoint_says_why(saving, said):
    assert said in run_summary(result(None), 2.0, "stopped", "llmtune sft r.yaml", CheckpointConfig(**saving))


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_export_says_its_dtype(dtype):
    summary = run_summary(result(Path("out/hf")), 2.0, "finished", "-", CheckpointConfig(export_dtype=dtype))
    assert summary.endswith(f"exported to out/hf ({dtype} weights: checkpoint.export_dtype).")
