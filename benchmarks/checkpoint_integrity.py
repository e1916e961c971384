"""The cost of checkpoint checksums (llmtune/checkpoint/manifest.py) per GiB, against writing that GiB.

    python benchmarks/checkpoint_integrity.py [--gib 1] [--dir /tmp]

Writes --gib GiB of random bytes to a file in --dir (fsync'd, the way a checkpoint shard lands), then hashes it
with the manifest's CRC-32 and, for comparison, with sha256, each read from the page cache as the rank that wrote
the file reads it right after its save (a verify on resume may read it from disk, which adds the disk's read time).
Prints seconds per GiB of each and their ratio to the write.
"""

import argparse
import hashlib
import os
import tempfile
import time
from pathlib import Path

from llmtune.checkpoint.manifest import checksum

BLOCK = 16 << 20


def write(path: Path, gib: float) -> float:
    block = os.urandom(BLOCK)
    started = time.perf_counter()
    with open(path, "wb") as file:
        for _ in range(int(gib * (1 << 30) // BLOCK)):
            file.write(block)
        file.flush()
        os.fsync(file.fileno())
    return time.perf_counter() - started


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(BLOCK):
            digest.update(block)
    return digest.hexdigest()


def timed(work, path: Path) -> float:
    started = time.perf_counter()
    work(path)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parsed = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=parsed.dir) as folder:
        path = Path(folder) / "shard.bin"
        written = write(path, parsed.gib) / parsed.gib
        crc = min(timed(checksum, path) for _ in range(3)) / parsed.gib
        sha = min(timed(sha256, path) for _ in range(3)) / parsed.gib
    print(f"write (fsync'd): {written:.3f} s/GiB")
    print(f"crc32 (manifest): {crc:.3f} s/GiB = {crc / written:.2f}x the write")
    print(f"sha256: {sha:.3f} s/GiB = {sha / written:.2f}x the write")


if __name__ == "__main__":
    main()
