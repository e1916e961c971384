"""Run in this process, or start N local processes through torchrun's own machinery."""

import os


def launched_by_torchrun() -> bool:
    """True inside a worker started by torchrun (or any launcher that sets the env:// variables)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", 1))


def launch_local(nproc: int, module_args: list[str]) -> int:
    """`torchrun --standalone --nproc-per-node N -m llmtune ARGS`; returns the job's exit code.

    A worker that stops on bad input exits 2, and so does the job: its peers then fail only
    because it left (a closed connection, or torchrun's signal).
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # This process has fetched every Hub id the run names: its workers read them from the cache alone, at the
    # commits it fetched, without a Hub call each.
    os.environ["HF_HUB_OFFLINE"] = "1"
    args = torchrun.parse_args(["--standalone", f"--nproc-per-node={nproc}", "--module", "llmtune", *module_args])
    try:
        torchrun.run(args)
    except ChildFailedError as err:
        return 2 if any(failure.exitcode == 2 for failure in err.failures.values()) else 1
    return 0
