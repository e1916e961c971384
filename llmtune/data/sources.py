"""Read local data files into a memory-mapped `datasets.Dataset`."""

from pathlib import Path

import datasets

from llmtune.errors import UserError

# .txt: one document per blank-line-separated paragraph, so a file can hold many documents.
BUILDERS = {".jsonl": ("json", {}), ".json": ("json", {}), ".txt": ("text", {"sample_by": "paragraph"})}


def load_rows(files: list[str]) -> datasets.Dataset:
    kinds = {BUILDERS[Path(f).suffix][0] for f in files}
    if len(kinds) > 1:
        raise UserError(f"data.train_files: mixes {' and '.join(sorted(kinds))} files ({', '.join(files)}); "
                        "use one kind of file per run")
    builder, options = BUILDERS[Path(files[0]).suffix]
    try:
        return datasets.load_dataset(builder, data_files=files, split="train", **options)
    except (datasets.exceptions.DatasetGenerationError, ValueError) as err:
        cause = err.__cause__ or err
        raise UserError(f"data.train_files: could not read {', '.join(files)}: {' '.join(str(cause).split())}") from None


def require_columns(dataset: datasets.Dataset, columns: tuple[str, ...], what: str, files: list[str]) -> None:
    missing = [c for c in columns if c not in dataset.column_names]
    if missing:
        raise UserError(f"{', '.join(files)}: {what} needs column(s) {', '.join(missing)}; the rows have "
                        f"{', '.join(dataset.column_names)} (set data.format to match the data)")
