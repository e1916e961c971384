"""Files and folders that appear whole or not at all: written under a temporary name, then swapped in, so that a run
stopped while writing leaves the earlier version or none, never half of one. Each file gets the permissions the
umask gives a new one."""

import os
import shutil
import stat
from pathlib import Path


def write_text(path: Path, text: str) -> None:
    """`path` holds `text` whole, or what it held before (os.replace is atomic within a folder)."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    partial.replace(path)


def write_folder(out_dir: Path, fill) -> None:
    """`fill(folder)` writes the folder's files under a temporary name, which is then swapped in: a failed export
    never leaves a half-written folder, and the one it replaces stays until the new one is complete."""
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    fill(partial)
    replaced = out_dir.with_name(out_dir.name + ".replaced")
    shutil.rmtree(replaced, ignore_errors=True)
    if out_dir.exists():
        out_dir.rename(replaced)
    partial.rename(out_dir)
    shutil.rmtree(replaced, ignore_errors=True)


def save_tensors(tensors: dict, path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, the file then given the permissions the umask gives any new file (0644 under 022):
    save_file (safetensors 0.8) creates it readable by its owner alone, which keeps a model shared on a cluster from
    the colleagues it is shared with."""
    from safetensors.torch import save_file

    save_file(tensors, path, metadata=metadata)
    os.chmod(path, new_file_mode(path.parent))


def new_file_mode(folder: Path) -> int:
    """The permissions a file created in `folder` gets, read from one: the umask can only be read by setting it,
    which would change it for the files other threads create meanwhile."""
    probe = folder / f".mode-{os.getpid()}"
    probe.touch(exist_ok=False)
    try:
        return stat.S_IMODE(probe.stat().st_mode)
    finally:
        probe.unlink()
