"""StopSignals on one process: a signal is noted, not acted on; a lower-numbered one that follows changes nothing, and
of signals that arrive together the highest-numbered is kept, whatever Python's order of handling them; its number is
what the trainer agrees on with the other ranks; the handlers it replaced come back after the loop."""

import os
import signal

from llmtune.training.stop_signals import StopSignals


def test_a_signal_is_noted_and_agreed_and_the_old_handlers_come_back_after_a_loop_it_did_not_stop():
    before, before_2 = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGUSR2)
    with StopSignals(["SIGUSR1", "SIGUSR2"]) as stop:
        assert stop.number == 0
    assert signal.getsignal(signal.SIGUSR1) is before
    try:
        with StopSignals(["SIGUSR1", "SIGUSR2"]) as stop:
            os.kill(os.getpid(), signal.SIGUSR2)
            os.kill(os.getpid(), signal.SIGUSR1)  # a second signal while stopping changes nothing
            assert stop.received == "SIGUSR2"
            assert stop.number == signal.SIGUSR2.value
        os.kill(os.getpid(), signal.SIGUSR1)  # after the loop a stopped run goes on ending: noted, not acted on
        assert stop.received == "SIGUSR2"
    finally:
        signal.signal(signal.SIGUSR1, before)
        signal.signal(signal.SIGUSR2, before_2)


def test_of_signals_that_arrive_together_the_highest_numbered_is_kept():
    """SIGTERM, then SIGINT, pending together (the main thread was inside a call): Python runs SIGINT's handler first,
    and the run still stops for SIGTERM, as the other ranks learn."""
    with StopSignals(["SIGTERM", "SIGINT"]) as stop:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
        assert stop.received == "SIGTERM" and stop.number == signal.SIGTERM.value


def test_no_signals_named_leaves_the_default_actions():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals([]) as stop:
        assert signal.getsignal(signal.SIGTERM) is before
        assert stop.number == 0
