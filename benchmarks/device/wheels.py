"""The wheels the lent GPU machine lacks for llmtune and the GPU proof, downloaded here into .whl/ (git-excluded).

    python benchmarks/device/wheels.py [--dest .whl]

The lent machine (PyTorch 2.11.0+cu130, Python 3.12.3, transformers 5.17.0, huggingface_hub 1.33.0, numpy 2.5.2,
...: the pip list its image holds) reaches no package registry: what it lacks travels beside the repository, 48 MiB
at most, and is installed there into a folder put first on PYTHONPATH, pip resolving nothing (--no-deps), so that
pip replaces nothing the image holds: the folder shadows the image's transformers and fsspec alone. Each wheel below is pinned, with why that version; the script downloads the
missing ones for CPython 3.12 on x86-64 Linux, removes every other file from the folder (two versions of a package
stop the install), prints each wheel's size and the total, and the line that installs them on the device. Exits 1
when the total is over the limit.

benchmarks/mirror_env.py installs the same folder the same way into a side environment that mirrors the machine,
and runs the suite there.
"""

import argparse
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIMIT_MIB = 48  # the working tree travels too, 64 MiB in all
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            *(arg for tag in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                              "manylinux2014_x86_64", "manylinux1_x86_64") for arg in ("--platform", tag))]

# What the machine's image holds, read from its pip list: the side environment pins these (mirror_env.py). Its
# other packages (UNPINNED_ON_DEVICE, and fsspec, which torch brings) are there at versions nobody has read; the
# side environment takes PyPI's newest.
ON_DEVICE = {
    "torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0", "tokenizers": "0.23.2",
    "huggingface_hub": "1.33.0", "safetensors": "0.8.0", "accelerate": "1.15.0", "numpy": "2.5.2",
    "sentencepiece": "0.2.2",
}
UNPINNED_ON_DEVICE = ["pandas", "pyarrow", "psutil", "pyyaml", "tqdm", "protobuf", "tensorboard", "matplotlib",
                      "requests", "httpx", "aiohttp", "xxhash", "filelock", "packaging", "jinja2", "regex", "rich",
                      "einops", "pillow", "typing-extensions", "pytest"]

# name: (version, why). Pure-Python wheels but for torchao's (abi3, built for torch >= 2.11).
CARRIED = {
    # The machine's 5.17 lacks what llmtune calls (activation_checkpointing_enable, 5.23) and the mark it finds a
    # mixture of experts' experts by (_is_expert_parallel): its MoE runs fail there.
    "transformers": ("5.24.0", "llmtune takes transformers >=5.23; the version CI runs"),
    # llmtune's data (data/sources.py reads every source through it)
    "datasets": ("5.2.0", "llmtune's data; the version CI runs"),
    "dill": ("0.4.1", "datasets 5.2.0 takes dill <0.4.2"),
    "multiprocess": ("0.70.19", "datasets 5.2.0 takes multiprocess <0.70.20"),
    "fsspec": ("2026.9.0", "datasets 5.2.0 takes fsspec <=2026.9.0; the image's version is unread"),
    # llmtune's adapters
    "peft": ("0.21.2", "llmtune takes peft >=0.21; the image's version is unread"),
    # model.quantize: nf4 and train.fp8
    "torchao": ("0.18.0", "its C++ kernels load on torch >= 2.11 (torchao/__init__.py), the version llmtune takes"),
    # train.fused_kernels
    "liger-kernel": ("0.8.5", "Liger's kernels for train.fused_kernels; takes torch >= 2.1.2, triton >= 2.3.1"),
    # the proof's baseline: 0.3.0 imports torch.distributed.fsdp.DataParallelMeshDims, which torch 2.11 lacks
    "torchtitan": ("0.2.2", "the last torchtitan that imports on torch 2.11"),
    "torchdata": ("0.11.0", "torchtitan's StatefulDataLoader"),
    "tyro": ("1.0.17", "torchtitan's command line"),
    "docstring-parser": ("0.18.0", "tyro 1.0.17 takes docstring-parser >=0.16"),
    "typeguard": ("4.6.1", "tyro 1.0.17 takes typeguard >=4.0"),
}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_key(path: Path) -> tuple[str, str]:
    """(normalized name, version) of a wheel file, from its name."""
    name, version = path.name.split("-")[:2]
    return normalized(name), version


def download(dest: Path) -> list[Path]:
    """Every CARRIED wheel in `dest`, downloading those missing; every other file there removed."""
    dest.mkdir(exist_ok=True)
    wanted = {normalized(name): version for name, (version, _) in CARRIED.items()}
    for stale in dest.iterdir():
        if stale.suffix != ".whl" or wanted.get(wheel_key(stale)[0]) != wheel_key(stale)[1]:
            stale.unlink()
    present = {wheel_key(path)[0] for path in dest.glob("*.whl")}
    for name, (version, _) in CARRIED.items():
        if normalized(name) not in present:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM, "-d", str(dest),
                            f"{name}=={version}"], check=True)
    wheels = sorted(dest.glob("*.whl"))
    missing = set(wanted) - {wheel_key(path)[0] for path in wheels}
    if missing:
        sys.exit(f"no wheel downloaded for {', '.join(sorted(missing))}")
    return wheels


# pip resolves nothing (--no-deps, --no-index): the image's packages stay as they are.
INSTALL = ["-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade",
           "--target"]


def install_line(dest: str, target: str = "/tmp/site") -> str:
    """The device command that installs the wheels into `target`, then puts it and the repository on the path
    (llmtune runs from the repository there: it is not installed)."""
    return f"python3 {' '.join(INSTALL)} {target} {dest}/*.whl && export PYTHONPATH={target}:$PWD"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", default=".whl", help="the folder, relative to the repository (default .whl)")
    args = parser.parse_args()
    wheels = download(REPO / args.dest)
    total = sum(path.stat().st_size for path in wheels)
    why = {normalized(name): reason for name, (_, reason) in CARRIED.items()}
    for path in wheels:
        print(f"{path.stat().st_size / 2**20:6.2f} MiB  {path.name}  ({why[wheel_key(path)[0]]})")
    print(f"{total / 2**20:6.2f} MiB  in all, {len(wheels)} wheels (limit {LIMIT_MIB} MiB)")
    print(f"\non the device, with {args.dest} carried:\n{install_line(args.dest)}")
    if total > LIMIT_MIB * 2**20:
        sys.exit(f"the wheels are over {LIMIT_MIB} MiB")


if __name__ == "__main__":
    main()
