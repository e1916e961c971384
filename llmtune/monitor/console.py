"""What rank 0 shows on the terminal. On a terminal (stderr is one): a progress bar that advances every optimizer
step, with the step's loss, learning rate and tokens/s after it, and every log line written above the bar
without breaking it. Elsewhere (a file, a pipe, a scheduler's log): no bar and plain lines. Every line, from the
monitor or from logging, starts with the time. output_dir/train.log gets the same lines as they are shown (not the
bar)."""

import contextlib
import logging
import sys
import time
from pathlib import Path

TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
RECORD_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
TRAIN_LOG = "train.log"
# The monitor's lines (Console.line), stamped as the terminal shows them, on their way to train.log alone: the
# terminal has them already, and no handler but train.log's is on this logger.
LINES = logging.getLogger("llmtune.console_lines")
LINES.propagate = False
LINES.setLevel(logging.INFO)


def configure_logging() -> None:
    """llmtune's messages at INFO, other libraries' at WARNING, each line with the time."""
    logging.basicConfig(level=logging.WARNING, format=RECORD_FORMAT, datefmt=TIME_FORMAT)
    logging.getLogger("llmtune").setLevel(logging.INFO)


class TrainLog(logging.FileHandler):
    """output_dir/train.log: logging's records as the terminal shows them, and the monitor's lines as they are."""

    def __init__(self, path: Path, append: bool):
        super().__init__(path, mode="a" if append else "w", encoding="utf-8")
        self.setFormatter(logging.Formatter(RECORD_FORMAT, TIME_FORMAT))

    def format(self, record: logging.LogRecord) -> str:
        return record.getMessage() if record.name == LINES.name else super().format(record)


def open_train_log(path: Path, append: bool) -> None:
    """Rank 0's console, from here on, also into `path` as each line is shown: started afresh, or added to when
    `append` (a run that goes on from its checkpoints continues its log). Replaces a train.log still open (a run in
    this process that did not close its own)."""
    close_train_log()
    handler = TrainLog(path, append)
    logging.getLogger().addHandler(handler)
    LINES.addHandler(handler)


def close_train_log(error: BaseException | None = None) -> None:
    """The end of train.log, if one is open: `error`, what ends the run with an error, as its last line (the
    terminal shows it in the command's own words once the run has unwound)."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, TrainLog)]:
        if error is not None:
            said = f": {error}" if str(error) else ""
            handler.emit(logging.LogRecord("llmtune", logging.ERROR, __file__, 0,
                                           f"the run ended with {type(error).__name__}{said}", None, None))
        root.removeHandler(handler)
        LINES.removeHandler(handler)
        handler.close()


class Console:
    """Rank 0's bar and lines, from the step training starts after (first_step, > 0 on resume) to close()."""

    def __init__(self, total_steps: int, first_step: int, bar: bool):
        self.bar = None
        self.redirect = contextlib.ExitStack()
        if bar and sys.stderr.isatty():
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            # Drawn on every step (no minimum interval): a step is seconds on real models, and each is wanted.
            self.bar = tqdm(total=total_steps, initial=first_step, desc="train", dynamic_ncols=True, mininterval=0)
            self.redirect.enter_context(logging_redirect_tqdm())

    def step(self, step: int, loss: float, lr: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tokens_per_s=f"{tokens_per_s:.0f}",
                                 refresh=False)
            self.bar.update(step - self.bar.n)

    def line(self, text: str) -> None:
        stamped = f"{time.strftime(TIME_FORMAT)} {text}"
        if self.bar is not None:
            self.bar.write(stamped, file=sys.stdout)
        else:
            print(stamped, flush=True)
        LINES.info(stamped)

    def close(self) -> None:
        self.redirect.close()
        if self.bar is not None:
            self.bar.close()
