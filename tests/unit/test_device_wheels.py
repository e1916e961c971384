"""benchmarks/device/wheels.py: the folder it leaves holds one wheel of each carried package, at its pinned version,
for the lent machine's Python and platform, and the line it prints installs them without resolving anything."""

import subprocess
from pathlib import Path

from tests.helpers import script_module

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "device" / "wheels.py"


def load():
    return script_module(SCRIPT)


def fake_pip(calls: list):
    """pip download as far as the folder sees it: the requirement's wheel appears under its wheel name."""
    def run(command, check):
        calls.append(command)
        name, version = command[-1].split("==")
        Path(command[command.index("-d") + 1], f"{name.replace('-', '_')}-{version}-py3-none-any.whl").touch()
        return subprocess.CompletedProcess(command, 0)
    return run


def test_the_folder_keeps_one_pinned_wheel_of_each_package_and_downloads_only_the_missing(tmp_path, monkeypatch):
    wheels = load()
    datasets, peft = wheels.CARRIED["datasets"][0], wheels.CARRIED["peft"][0]
    (tmp_path / f"datasets-{datasets}-py3-none-any.whl").touch()
    (tmp_path / "peft-0.1.0-py3-none-any.whl").touch()  # another version: two stop the device's install
    (tmp_path / "numpy-2.0.0-cp312-cp312-manylinux_2_17_x86_64.whl").touch()  # not carried
    (tmp_path / "notes.txt").touch()
    calls = []
    monkeypatch.setattr(wheels.subprocess, "run", fake_pip(calls))
    kept = wheels.download(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(path.name for path in kept)
    assert sorted(wheels.wheel_key(path) for path in kept) == sorted(
        (wheels.normalized(name), version) for name, (version, _) in wheels.CARRIED.items())
    asked = [command[-1] for command in calls]
    assert f"peft=={peft}" in asked and f"datasets=={datasets}" not in asked
    assert len(asked) == len(wheels.CARRIED) - 1
    for command in calls:
        assert command[command.index("--python-version") + 1] == "3.12"
        assert "--no-deps" in command and "--only-binary=:all:" in command


def test_the_install_line_resolves_nothing_and_puts_the_repository_on_the_path():
    line = load().install_line(".whl")
    install, export = line.split(" && ")
    assert install.startswith("python3 -m pip install") and install.endswith("--target /tmp/site .whl/*.whl")
    assert {"--no-index", "--no-deps", "--upgrade"} <= set(install.split())
    assert export == "export PYTHONPATH=/tmp/site:$PWD"
