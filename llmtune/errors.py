"""The one exception type for bad user input (recipe, data, paths, CLI): exit code 2."""


class UserError(Exception):
    """Input the user can fix; the message says what was wrong, where, and the fix."""

    exit_code = 2
