"""Run in this process, or start N local processes through torchrun's own machinery."""

import os

LOCAL_NPROC = "LLMTUNE_NPROC"  # set by launch_local for its workers
# The recipe's auto settings as the launching process decided them (JSON), for launch_local's workers.
AUTO_SETTINGS = "LLMTUNE_AUTO_SETTINGS"


def launched_by_torchrun() -> bool:
    """True inside a worker started by torchrun (or any launcher that sets the env:// variables)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", 1))


def rank_from_env() -> int:
    return int(os.environ.get("RANK", 0))


def local_nproc() -> str | None:
    """N inside a worker that `llmtune ... --nproc N` started (launch_local), else None."""
    return os.environ.get(LOCAL_NPROC)


def launch_local(nproc: int, module_args: list[str], env: dict[str, str] | None = None) -> int:
    """`torchrun --standalone --nproc-per-node N -m llmtune ARGS`; returns the job's exit code. env: variables the
    workers get for this launch alone (this process has them while it waits for them).

    A worker that stops on bad input exits 2, and so does the job: its peers then fail only
    because it left (a closed connection, or torchrun's signal). Workers stopped by a signal
    (train.save_on_signals) exit 75, and so does the job, also when the signal reached torchrun
    itself, which passes it on to the workers and gives them its --shutdown-timeout (30 s) to
    finish their save.
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from llmtune.errors import Preempted, UserError
    from llmtune.run.threads import launch_env

    # This process has fetched every Hub id the run names: its workers read them from the cache alone, at the
    # commits it fetched, without a Hub call each.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ[LOCAL_NPROC] = str(nproc)
    args = torchrun.parse_args(["--standalone", f"--nproc-per-node={nproc}", "--module", "llmtune", *module_args])
    env = {**launch_env(nproc), **(env or {})}  # each worker's threads: its share of the cores, not torchrun's 1
    os.environ.update(env)
    try:
        torchrun.run(args)
    except ChildFailedError as err:
        codes = {failure.exitcode for failure in err.failures.values()}
        return next((code for code in (UserError.exit_code, Preempted.exit_code) if code in codes), 1)
    except SignalException:
        return Preempted.exit_code
    finally:
        for name in env:
            del os.environ[name]
    return 0
