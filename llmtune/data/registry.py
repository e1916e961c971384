"""The sources of a split: data.train_files / data.val_files / data.test_files, and the datasets named in a
LLaMA-Factory dataset_info.json (data.dataset_info with data.datasets / data.val_datasets / data.test_datasets),
read as LLaMA-Factory reads them: file_name beside the registry, formatting alpaca or sharegpt, the columns and tags
mappings. Standard library only: the CLI checks every source with it before torch or datasets is imported.

Where LLaMA-Factory is silent or lenient this is strict, so that nothing is trained other than what was meant:
an entry that is not the task's kind of rows (a ranking: true entry is preference pairs, for dpo alone; a kto_tag
entry KTO's examples, for kto alone) or that llmtune cannot read (videos, audio, ModelScope, scripts, cloud files) is
refused with the reason, not skipped. An hf_hub_url entry (its subset and split) is the Hub dataset data.train_files
names as org/name:subset:split, read from the huggingface_hub cache offline. Tags an entry leaves out keep LLaMA-Factory's default names (a "system" role stays a system turn);
columns it leaves out are not read, as in LLaMA-Factory, except the ones the form needs.
"""

import difflib
import json
from dataclasses import dataclass
from pathlib import Path

from llmtune.data.formats import ENTRY_FORMS, FORMS, SHAREGPT_TAGS, RowFormat, other_rows_error
from llmtune.errors import UserError
from llmtune.tasks.registry import DOCUMENTS, PAIRS, TASKS, UNPAIRED

REGISTRY_FILE = "dataset_info.json"
FORMATTINGS = ("alpaca", "sharegpt")
ENTRY_KEYS = ("file_name", "formatting", "columns", "tags", "ranking", "file_sha1")
MULTIMODAL = ("videos", "audios")  # what llmtune does not read; images it does (data/images.py)
HUB_KEYS = ("hf_hub_url", "subset", "split")  # LLaMA-Factory's keys of a Hub dataset's entry
ELSEWHERE = ("ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")


@dataclass(frozen=True)
class Source:
    """One source of a split. row_format None: the form is detected from the columns (data.format)."""
    pattern: str
    key: str
    row_format: RowFormat | None = None
    # Where the rows' relative image paths are (LLaMA-Factory's dataset_dir); None: beside the data file.
    media_dir: str | None = None


def split_sources(data_cfg, task: str, split: str) -> list[Source]:
    """The training (split "train"), validation ("val") or test ("test") sources, in the recipe's order: files, then
    datasets."""
    files, names, key = {"train": (data_cfg.train_files, data_cfg.datasets, "data.datasets"),
                         "val": (data_cfg.val_files, data_cfg.val_datasets, "data.val_datasets"),
                         "test": (data_cfg.test_files, data_cfg.test_datasets, "data.test_datasets")}[split]
    sources = [Source(p, f"data.{split}_files") for p in files]
    if names:
        path = registry_path(data_cfg.dataset_info)
        entries = read_registry(path)
        sources += [registry_source(entries, name, path, key, task) for name in names]
    return sources


def registry_path(dataset_info: str) -> Path:
    """data.dataset_info names the file or, as LLaMA-Factory's dataset_dir, the folder holding it."""
    path = Path(dataset_info)
    return path / REGISTRY_FILE if path.is_dir() else path


def read_registry(path: Path) -> dict:
    if not path.is_file():
        raise UserError(f"data.dataset_info: {path} not found; name a LLaMA-Factory dataset_info.json or the folder "
                        "holding it")
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"data.dataset_info: {path} is not valid JSON ({err})") from None
    if not isinstance(entries, dict):
        raise UserError(f"data.dataset_info: {path} must map dataset names to their descriptions")
    return entries


def registry_source(entries: dict, name: str, path: Path, key: str, task: str) -> Source:
    if name not in entries:
        close = difflib.get_close_matches(name, list(entries), n=3)
        hint = f"did you mean {', '.join(close)}?" if close else f"it has {', '.join(list(entries)[:20])}"
        raise UserError(f"{key}: no dataset {name!r} in {path}; {hint}")
    entry = entries[name]
    where = f"{key}: {name!r} in {path}"
    if not isinstance(entry, dict):
        raise UserError(f"{where}: the description must be a JSON object")
    columns, tags = entry.get("columns", {}), entry.get("tags", {})
    for field_name, mapping in (("columns", columns), ("tags", tags)):
        if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
            raise UserError(f"{where}: {field_name} must map names to strings")
    # The entry's flags and column roles that say what its rows are.
    marks = [flag for flag in (*entry, *columns) if entry.get(flag) or columns.get(flag)]
    if error := other_rows_error(where, marks, False, task, key):
        raise error
    if modal := [name for name in MULTIMODAL if name in marks]:
        raise UserError(f"{where}: {modal[0]} are not read (llmtune trains on images and text); leave it out of {key}")
    hosted = [k for k in ELSEWHERE if k in entry]
    if hosted and "file_name" not in entry and "hf_hub_url" not in entry:
        raise UserError(f"{where}: {hosted[0]} is not read from dataset_info.json; download the files and set "
                        f"file_name, or give the entry an hf_hub_url")
    unknown = [k for k in entry if k not in ENTRY_KEYS + HUB_KEYS + ELSEWHERE]
    if unknown:
        raise UserError(f"{where}: {', '.join(unknown)} not supported; an entry may have "
                        f"{', '.join(ENTRY_KEYS + HUB_KEYS)}")
    row_format = _row_format(entry, columns, tags, task, where)
    if "hf_hub_url" in entry:  # before file_name, as LLaMA-Factory reads an entry that has both
        return Source(hub_pattern(entry, where), key, row_format)
    if not isinstance(entry.get("file_name"), str):
        raise UserError(f"{where}: file_name is missing; name the data file or folder beside {path.name}")
    file = path.parent / entry["file_name"]
    if not file.exists():
        raise UserError(f"{where}: file_name {entry['file_name']!r} does not exist ({file}); fix file_name or add "
                        "the file")
    return Source(str(file), key, row_format, str(path.parent))


def hub_pattern(entry: dict, where: str) -> str:
    """An hf_hub_url entry as data.train_files names a Hub dataset: org/name:subset:split (LLaMA-Factory's split
    default, train; no subset: the dataset's default config)."""
    values = {k: entry.get(k) for k in HUB_KEYS}
    if wrong := [k for k, v in values.items() if v is not None and not (isinstance(v, str) and v and ":" not in v)]:
        raise UserError(f"{where}: {wrong[0]} must be a name without ':' (hf_hub_url org/name, subset, split)")
    return f"{values['hf_hub_url']}:{values['subset'] or ''}:{values['split'] or 'train'}"


def _row_format(entry: dict, columns: dict, tags: dict, task: str, where: str) -> RowFormat:
    formatting = entry.get("formatting", "alpaca")
    if formatting not in FORMATTINGS:
        raise UserError(f"{where}: formatting {formatting!r} is not supported; use alpaca or sharegpt")
    rows = TASKS[task].rows
    if rows == DOCUMENTS:
        # LLaMA-Factory's pre-training entries name the text column as the prompt column.
        return RowFormat.of("text", columns={"text": columns.get("prompt", "text")})
    if rows == PAIRS:
        if not entry.get("ranking"):
            raise UserError(f"{where}: not preference data; llmtune {task} trains pairs of a chosen and a rejected "
                            "response, which an entry marks with ranking: true (and its chosen and rejected columns)")
    if rows == UNPAIRED and not columns.get("kto_tag"):
        raise UserError(f"{where}: not KTO data; llmtune {task} trains responses labelled desirable or undesirable, "
                        "which an entry marks with its label column as columns.kto_tag (e.g. \"kto_tag\": \"label\")")
    form = ENTRY_FORMS[rows][formatting] if rows in ENTRY_FORMS else formatting
    defaults, required = FORMS[form]
    wrong = [c for c in columns if c not in defaults]
    if wrong:
        raise UserError(f"{where}: columns {', '.join(wrong)} not known for formatting {formatting}; use "
                        f"{', '.join(defaults)}")
    chosen = {**{role: defaults[role] for role in required}, **columns} if "columns" in entry else None
    wrong_tags = [t for t in tags if t not in SHAREGPT_TAGS]
    if wrong_tags:
        raise UserError(f"{where}: tags {', '.join(wrong_tags)} not known; use {', '.join(SHAREGPT_TAGS)}")
    return RowFormat.of(form, columns=chosen, tags=tags)
