"""StopSignals on one process: a signal is noted, not acted on; the first one is kept whatever follows; its number is
what the trainer agrees on with the other ranks; the handlers it replaced come back after the loop."""

import os
import signal

from llmtune.training.stop_signals import StopSignals


def test_a_signal_is_noted_and_agreed_and_the_old_handlers_come_back():
    before = signal.getsignal(signal.SIGUSR1)
    with StopSignals(["SIGUSR1", "SIGUSR2"]) as stop:
        assert stop.number == 0
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGUSR1)  # a second signal while stopping changes nothing
        assert stop.received == "SIGUSR2"
        assert stop.number == signal.SIGUSR2.value
    assert signal.getsignal(signal.SIGUSR1) is before


def test_no_signals_named_leaves_the_default_actions():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals([]) as stop:
        assert signal.getsignal(signal.SIGTERM) is before
        assert stop.number == 0
