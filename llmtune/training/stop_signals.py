"""Signals that stop a run cleanly (train.save_on_signals): a scheduler's preemption (SIGTERM), Ctrl-C (SIGINT), a
warning before a time limit (SIGUSR1). The handler only notes the signal; the trainer asks every rank after each
optimizer step whether any rank got one, so all ranks stop at the same step, save there and exit together. Later
signals find the note already taken and change nothing, so a second signal during the save cannot cut it short."""

import logging
import signal

log = logging.getLogger(__name__)


class StopSignals:
    """Installed for the training loop (`with StopSignals(names) as stop:`); the handlers it replaced come back
    after it, unless a signal stopped the run: the process is then ending, and its later signals are noted until it
    exits, not acted on (a second Ctrl-C in the moments after the save would end a stopped run with 130 and
    "interrupted" instead of 75 and the command that resumes, depending on when it came). llmtune.train, which
    returns to its caller, puts the caller's handlers back itself (run/api.py)."""

    def __init__(self, names: list[str]):
        self.signals = [signal.Signals[name] for name in names]
        self.received: str | None = None
        self.previous = {}

    def __enter__(self) -> "StopSignals":
        for sig in self.signals:
            self.previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc) -> None:
        if self.received is None:
            for sig, handler in self.previous.items():
                signal.signal(sig, handler)

    def _note(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = name
            log.warning("%s received: saving a checkpoint at the end of this optimizer step, then stopping", name)
            return
        log.warning("%s received: already stopping after %s; the save goes on", name, self.received)
        # Signals that arrive while the main thread is inside a call (a collective, a save) wait for it together, and
        # Python then runs their handlers by number, not by arrival: the highest-numbered stands for them here, as it
        # does over the ranks (`number`), whichever came first.
        if signum > signal.Signals[self.received].value:
            self.received = name

    @property
    def number(self) -> int:
        """The number of the signal this rank received (the highest-numbered, where several came before the step
        ended), 0 for none: the trainer agrees on it with every rank after each optimizer step (the highest-numbered
        wins), so all ranks stop at the same step."""
        return signal.Signals[self.received].value if self.received else 0
