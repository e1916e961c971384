"""Data sources -> the files they name, and whether each holds rows. Standard library only: the CLI
checks every path with it before torch or datasets is imported."""

import glob
from functools import partial
from pathlib import Path

from llmtune.config import DATA_SUFFIXES
from llmtune.errors import UserError


def is_saved_dataset(path: str) -> bool:
    """A folder written by datasets' save_to_disk (one split, or a DatasetDict)."""
    folder = Path(path)
    return (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()


def resolve_data_files(patterns: list[str], key: str) -> list[str]:
    """Expand files, folders (their data files, sorted) and globs into a list of files."""
    files: list[str] = []
    for pattern in patterns:
        path = Path(pattern)
        if path.is_dir():
            found = sorted(str(p) for p in path.rglob("*") if p.suffix in DATA_SUFFIXES and p.is_file())
        elif glob.has_magic(pattern):
            found = sorted(p for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
        else:
            found = [pattern] if path.is_file() else []
        if not found:
            raise UserError(f"{key}: {pattern!r} matches no data file; check the path (relative paths are "
                            f"read from the current directory {Path.cwd()})")
        for name in found:
            if Path(name).suffix not in DATA_SUFFIXES:
                raise UserError(f"{key}: {name} is not a supported data file; use one of {', '.join(DATA_SUFFIXES)} "
                                "or a folder written by save_to_disk")
        files.extend(found)
    return files


def check_has_rows(name: str, key: str) -> None:
    """Refuse a data file without a row, which datasets reads into a traceback (StopIteration) or a
    message that names neither the file nor the fix."""
    problem = _missing_rows(name)
    if problem:
        raise UserError(f"{key}: {name} {problem}; add rows to it or take it out of {key}")


def _missing_rows(name: str) -> str | None:
    """What makes the file rowless, or None. Reads only up to its first rows."""
    if Path(name).stat().st_size == 0:
        return "is empty"
    if Path(name).suffix == ".parquet":
        return None
    header = Path(name).suffix == ".csv"
    with open(name, "rb") as f:
        # Pieces of at most 64 KiB: a minified .json file is one line that need not be read whole.
        filled = (piece for piece in iter(partial(f.readline, 1 << 16), b"") if piece.strip())
        if next(filled, None) is None:
            return "holds only blank lines"
        if header and next(filled, None) is None:
            return "has a header line but no rows"
    return None
