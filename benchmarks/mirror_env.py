"""A side environment that mirrors the lent GPU machine's Python stack, here on the CPU, and the quick tests in it.

    python benchmarks/mirror_env.py TORCH_VERSION [PYTHON] [--venv DIR] [-- PYTEST_ARGS...]

Builds DIR (default: mirror-torch<TORCH_VERSION> beside the repository) with PYTHON (default python3.12, the
machine's; 3.12 or later, which numpy 2.5.2 takes): torch TORCH_VERSION from PyPI (the CUDA build, several GB with
its nvidia libraries: it runs on the CPU), the machine's versions of what llmtune imports
(device/wheels.py's ON_DEVICE), llmtune itself with --no-deps, then the wheels the machine lacks (device/wheels.py),
installed into DIR/site exactly as on the machine and put on PYTHONPATH. Then runs pytest -m "not slow" there, or
the PYTEST_ARGS given after --. Run again, it reinstalls nothing pip finds in place. Not part of CI.
"""

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from device.wheels import INSTALL, ON_DEVICE, REPO, UNPINNED_ON_DEVICE, download

# Only the tests need these: the trackers' sinks the suite logs to offline, absent from the machine.
TEST_ONLY = ["wandb", "mlflow-skinny"]


def run(*command, **kwargs) -> None:
    print("+", " ".join(map(str, command)), flush=True)
    subprocess.run(command, check=True, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Arguments after -- go to pytest (default: -m 'not slow').")
    parser.add_argument("torch_version", help="e.g. 2.11.0")
    parser.add_argument("python", nargs="?", default="python3.12", help="the interpreter (default python3.12)")
    parser.add_argument("--venv", type=Path, help="the environment's folder (default: beside the repository)")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    pytest_args = argv[split + 1:] or ["-m", "not slow"]
    venv = args.venv or REPO.parent / f"mirror-torch{args.torch_version}"
    if shutil.which(args.python) is None:
        sys.exit(f"{args.python}: no such interpreter; name a Python 3.12 (or later) as the second argument")
    version = subprocess.run([args.python, "-c", "import sys; print(*sys.version_info[:2])"], check=True,
                             capture_output=True, text=True).stdout.split()
    if tuple(map(int, version)) < (3, 12):
        sys.exit(f"{args.python} is Python {'.'.join(version)}: the machine's numpy {ON_DEVICE['numpy']} needs 3.12 "
                 f"or later; name a Python 3.12 as the second argument")
    python = venv / "bin" / "python"
    if not python.exists():
        run(args.python, "-m", "venv", venv)
    # One resolution, so that pip keeps every pin at once; torch brings its own triton.
    run(python, "-m", "pip", "install", "-q", f"torch=={args.torch_version}",
        *(f"{name}=={pinned}" for name, pinned in ON_DEVICE.items() if name not in ("torch", "triton")),
        *UNPINNED_ON_DEVICE, *TEST_ONLY)
    run(python, "-m", "pip", "install", "-q", "--no-deps", "-e", REPO)
    site = venv / "site"
    shutil.rmtree(site, ignore_errors=True)
    run(python, *INSTALL, site, *download(REPO / ".whl"))
    # The bytecode the machine's first import writes beside the sources (--no-compile installs none). Without it,
    # where PYTHONDONTWRITEBYTECODE is set, every process compiles torchao anew and prints its SyntaxWarning (an
    # invalid escape in a docstring) on stderr, which the tests that read a refusal's stderr whole count.
    run(python, "-W", "ignore", "-m", "compileall", "-q", site, stdout=subprocess.DEVNULL)
    # Activated: bin/llmtune, which the tests run, takes the active environment's python3, else the repository's .venv.
    env = {**os.environ, "PYTHONPATH": str(site), "VIRTUAL_ENV": str(venv),
           "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    run(python, "-c", "import torch, transformers; print('torch', torch.__version__, 'transformers', "
                      "transformers.__version__)", env=env)
    sys.exit(subprocess.run([python, "-m", "pytest", "-q", *pytest_args], cwd=REPO, env=env).returncode)


if __name__ == "__main__":
    main()
