"""output_dir/train.log: logging's records and the monitor's lines as rank 0's console shows them, started afresh
by a new run, added to by one that goes on, ended by the error that ends a run. On a real run:
tests/e2e/test_console.py and tests/e2e/test_output_dir.py."""

import logging
import re

import pytest

from llmtune.monitor.console import Console, close_train_log, open_train_log

STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"


@pytest.fixture
def log():
    logger = logging.getLogger("llmtune.test_train_log")
    logger.setLevel(logging.INFO)
    yield logger
    close_train_log()


def test_train_log_holds_the_records_and_the_lines_as_the_console_shows_them(tmp_path, log, capsys):
    path = tmp_path / "train.log"
    open_train_log(path, append=False)
    log.info("data: %d rows", 12)
    console = Console(total_steps=2, first_step=0, bar=False)
    console.line("step 1/2 loss 3.0000")
    logging.getLogger("a_library").warning("a library's warning")
    close_train_log()
    log.info("after the run")
    shown = capsys.readouterr().out.splitlines()
    lines = path.read_text().splitlines()
    assert re.fullmatch(fr"{STAMP} INFO llmtune.test_train_log: data: 12 rows", lines[0]), lines
    assert lines[1] == shown[0] and re.fullmatch(fr"{STAMP} step 1/2 loss 3.0000", lines[1]), (lines, shown)
    assert re.fullmatch(fr"{STAMP} WARNING a_library: a library's warning", lines[2]), lines
    assert len(lines) == 3 and len(shown) == 1, "the line is shown once; nothing after the close"


def test_a_new_run_starts_it_afresh_a_run_that_goes_on_adds_to_it_and_an_error_ends_it(tmp_path, log):
    path = tmp_path / "train.log"
    path.write_text("an earlier run\n")
    open_train_log(path, append=False)
    log.info("first")
    close_train_log(ValueError("data: too few samples"))
    open_train_log(path, append=True)
    log.info("resumed")
    open_train_log(path, append=True)  # a run in this process that did not close its own is replaced, not doubled
    log.info("once")
    close_train_log()
    lines = [line.split(" ", 2)[2] for line in path.read_text().splitlines()]
    assert lines == ["INFO llmtune.test_train_log: first",
                     "ERROR llmtune: the run ended with ValueError: data: too few samples",
                     "INFO llmtune.test_train_log: resumed", "INFO llmtune.test_train_log: once"]
