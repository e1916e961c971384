"""Files and folders that appear whole or not at all: written under a temporary name, then swapped in, so that a run
stopped while writing leaves the earlier version or none, never half of one."""

import shutil
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
