"""manifest.json: every file of a checkpoint with its size and checksum, written last, before the folder is renamed
into place. Each rank hashes the files it wrote itself (its DCP shards `__<rank>_*.distcp`, its extra_state/rank_<r>.pt;
rank 0 everything else), while they are still in its page cache; rank 0 writes the manifest.

Checks: every listed file is there with its size (always, it costs a stat per file); with checksums, every byte is
read again and hashed (`checkpoint.verify_checksums`, `llmtune export --verify`)."""

import json
import re
import zlib
from pathlib import Path

MANIFEST = "manifest.json"
_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")
_RNG = re.compile(r"^extra_state/rank_(\d+)\.pt$")
_BLOCK = 16 << 20


def writer(relative: str) -> int:
    """The rank that wrote the checkpoint file at `relative` (a POSIX path inside the checkpoint folder)."""
    found = _SHARD.match(relative) or _RNG.match(relative)
    return int(found.group(1)) if found else 0


def checksum(path: Path) -> str:
    """CRC-32 of the file, as 8 hex digits. A checksum against corruption, not against tampering: zlib's CRC-32
    hashed 3.3 GiB/s here against sha256's 1.4 (benchmarks/checkpoint_integrity.py)."""
    crc = 0
    with open(path, "rb") as file:
        while block := file.read(_BLOCK):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def files_written_by(folder: Path, rank: int) -> dict[str, dict]:
    """{relative path: {"size", "crc32"}} of the files under `folder` that `rank` wrote."""
    entries = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        relative = path.relative_to(folder).as_posix()
        if relative != MANIFEST and writer(relative) == rank:
            entries[relative] = {"size": path.stat().st_size, "crc32": checksum(path)}
    return entries


def write_manifest(folder: Path, per_rank: list[dict[str, dict]]) -> None:
    files = {name: entry for entries in per_rank for name, entry in entries.items()}
    (folder / MANIFEST).write_text(json.dumps({"files": dict(sorted(files.items()))}, indent=1))


def manifest_problems(folder: Path, checksums: bool) -> list[str]:
    """What is wrong with the checkpoint's files against its manifest (empty: it holds). A checkpoint written before
    manifests existed has none: nothing to check (validate.check_complete still checks its shards' sizes)."""
    listing = folder / MANIFEST
    if not listing.is_file():
        return []
    problems = []
    for name, entry in json.loads(listing.read_text())["files"].items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != entry["size"]:
            problems.append(f"{name} has {path.stat().st_size} bytes, not the {entry['size']} written")
        elif checksums and checksum(path) != entry["crc32"]:
            problems.append(f"{name} does not match its checksum (its bytes changed after the save)")
    return problems
