"""The exceptions that end a run with one message instead of a traceback."""


class UserError(Exception):
    """Input the user can fix (recipe, data, paths, CLI); the message says what was wrong, where, and the fix."""

    exit_code = 2


class TrainingStopped(Exception):
    """Training cannot go on (e.g. the loss keeps diverging); the message says why and what to try."""

    exit_code = 1


class Preempted(Exception):
    """A stop signal (train.save_on_signals): every rank saved a checkpoint at the same step and stops; the message
    says where, and the command that resumes."""

    exit_code = 75  # EX_TEMPFAIL of sysexits.h: a temporary failure, to be retried
