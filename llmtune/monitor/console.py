"""What rank 0 shows on the terminal. On a terminal (stderr is one): a progress bar that advances every optimizer
step, with the step's loss, learning rate and tokens/s after it, and every log line written above the bar
without breaking it. Elsewhere (a file, a pipe, a scheduler's log): no bar and plain lines. Every line, from the
monitor or from logging, starts with the time."""

import contextlib
import logging
import sys
import time

TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


def configure_logging() -> None:
    """llmtune's messages at INFO, other libraries' at WARNING, each line with the time."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt=TIME_FORMAT)
    logging.getLogger("llmtune").setLevel(logging.INFO)


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

    def close(self) -> None:
        self.redirect.close()
        if self.bar is not None:
            self.bar.close()
