"""checkpoint.save_best: the saved checkpoint with the best checkpoint.best_metric so far, kept as checkpoints/best.

It is a whole checkpoint folder of its own (checkpoint.resume_from_checkpoint: best, `llmtune export` and
checkpoint.export_from: best read it as any other), made of hard links to the files of the global_step_N folder it
copies: a published checkpoint's files are never written again, so the links cost no space, and retention, which
removes global_step_N folders only, never takes the best one's files with them.
"""

import os
import shutil
from pathlib import Path

from llmtune.atomic import write_folder

BEST = "best"


def better(value: float, best: float | None, greater_is_better: bool, threshold: float = 0.0) -> bool:
    """Whether `value` improves on `best` (None: nothing yet) by more than `threshold`."""
    if best is None:
        return True
    return (value - best if greater_is_better else best - value) > threshold


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # a filesystem without hard links
        shutil.copy2(source, target)


def keep_as_best(checkpoint: Path) -> Path:
    """checkpoints/best becomes `checkpoint`'s copy, swapped in whole (the previous best stays until it is)."""
    best = checkpoint.parent / BEST

    def fill(folder: Path) -> None:
        folder.rmdir()  # copytree makes it
        shutil.copytree(checkpoint, folder, copy_function=_link_or_copy)

    write_folder(best, fill)
    return best
