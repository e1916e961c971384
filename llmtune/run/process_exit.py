"""How an llmtune process ends: its threads joined and its exit handlers run while the interpreter is whole, then
the process exits without the interpreter's finalization.

Why: gloo's (and nccl's) worker threads let go of a finished collective a moment after the rank that waited on it
has moved on, and letting go releases its tensors' Python objects, which takes the GIL. When the main thread has
begun finalizing the interpreter by then, Python ends the worker thread by unwinding its stack; the unwind meets a
C++ frame that may not throw and the process aborts ("terminate called without an active exception", exit -6)
after a run that succeeded. destroy_process_group does not stop those threads. A core dump of one such abort (about
1 in 35 two-process runs on a busy 2-core machine) shows it: ProcessGroupGloo::runLoop -> ~AsyncAllreduceWork ->
TensorImpl::decref_pyobject -> take_gil -> PyThread_exit_thread -> std::terminate. What finalization would still
do, free every object, the operating system does at exit.
"""

import atexit
import os
import signal
import sys
import threading
import traceback
from typing import Callable, NoReturn


def run_and_exit(main: Callable[[], int | None]) -> NoReturn:
    """Run main() and end the process with its exit code (an uncaught exception: its traceback and 1)."""
    try:
        code = main()
    except SystemExit as stop:
        code = stop.code
    except BrokenPipeError:
        code = _reader_gone()
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, then the same exit path
        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    # What the interpreter does before finalizing, in its order: threading's exit hooks (they tell the workers of a
    # concurrent.futures executor a library left open to stop; joining those workers first waits forever), the
    # joins of the threads that are not daemons, then the exit handlers (trackers' last writes, logging, compile
    # workers). threading._shutdown is the function the interpreter calls for the first two.
    threading._shutdown()
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        code = _reader_gone()
    sys.stderr.flush()
    os._exit(code or 0)


def _reader_gone() -> int:
    """The reader of stdout went away (`llmtune sft --help | head`): end quietly, as a program that Python does not
    shield from SIGPIPE ends. What is still buffered for stdout goes nowhere instead of raising again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 128 + signal.SIGPIPE
