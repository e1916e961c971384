"""What an output_dir holds of a run, read without torch (the CLI checks it before any process starts): its
complete checkpoints up to the `latest` pointer, its exports, and starting over (train.overwrite_output_dir)."""

import re
import shutil
from pathlib import Path

from llmtune.config import RESUME_BEST, RESUME_NEWEST
from llmtune.errors import UserError

STEP_DIR = re.compile(r"^global_step_(\d+)$")
LATEST = "latest"
EXPORTS = ("hf", "adapter")  # the folders hf_export publishes
EMA_EXPORTS = ("hf_ema", "adapter_ema")  # and those of the moving averages (hf_ema_<decay> for several)
REQUIRED = (".metadata", "trainer_state.json", "config.yaml")  # the files of every checkpoint


def _step(path: Path) -> int | None:
    match = STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def check_checkpoint_folder(path: Path) -> None:
    """`path` is a finished checkpoint's folder, with the files every checkpoint holds: the checks of a checkpoint
    that need no torch, so that `llmtune export` refuses a wrong folder before torch is imported
    (validate.check_complete makes them first)."""
    if not path.is_dir():
        raise UserError(f"{path}: no such checkpoint folder")
    if path.name.startswith("."):
        raise UserError(f"{path}: an unfinished checkpoint (its save never completed); resume from a "
                        "global_step_N folder or from latest")
    missing = [name for name in REQUIRED if not (path / name).is_file()]
    if missing:
        raise UserError(f"{path}: incomplete checkpoint, missing {', '.join(missing)}; use another checkpoint")


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoint folders of the run that wrote `latest`, oldest first. A checkpoint newer than the
    step `latest` names is not that run's newest: it was left by another run in the same folder (a run that started
    over there, or went back to an older checkpoint), and resuming from it would mix two runs."""
    if not root.is_dir():
        return []
    found = sorted((step, p) for p in root.iterdir() if (step := _step(p)) is not None and p.is_dir())
    pointer = root / LATEST
    newest = _step(Path(pointer.read_text().strip())) if pointer.is_file() else None
    return [p for step, p in found if newest is None or step <= newest]


def continues(output_dir: Path, resume: str | None) -> bool:
    """Whether checkpoint.resume_from_checkpoint goes on from one of output_dir's own checkpoints (auto/latest, best,
    or a folder of output_dir/checkpoints)."""
    if not resume:
        return False
    return resume in (*RESUME_NEWEST, RESUME_BEST) or Path(resume).resolve().is_relative_to((output_dir / "checkpoints").resolve())


def earlier_run(output_dir: Path) -> list[str]:
    """What output_dir holds that another run would mix with: its checkpoints and its exports (names, for a
    message); empty for a new folder."""
    root = output_dir / "checkpoints"
    held = []
    if root.is_dir() and any(_step(p) is not None or p.name == LATEST for p in root.iterdir()):
        held.append("checkpoints")
    return held + [f"an export ({name}/)" for name in exports(output_dir)]


def exports(output_dir: Path) -> list[str]:
    """The names of the export folders output_dir holds."""
    if not output_dir.is_dir():
        return []
    return sorted(p.name for p in output_dir.iterdir() if p.is_dir() and (p.name in EXPORTS or any(
        p.name == name or p.name.startswith(f"{name}_") for name in EMA_EXPORTS)))


def remove_earlier_run(output_dir: Path) -> None:
    """train.overwrite_output_dir: the checkpoints and exports of the run that was there, removed before this one
    writes anything, so that neither a resume nor the summary can find them."""
    for name in ("checkpoints", *exports(output_dir)):
        shutil.rmtree(output_dir / name, ignore_errors=True)
