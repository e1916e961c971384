"""The exceptions that end a run with one message instead of a traceback."""


class UserError(Exception):
    """Input the user can fix (recipe, data, paths, CLI); the message says what was wrong, where, and the fix."""

    exit_code = 2


class TrainingStopped(Exception):
    """Training cannot go on (e.g. the loss keeps diverging); the message says why and what to try."""

    exit_code = 1
