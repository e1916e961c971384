"""The command lines llmtune's messages tell the user to run (resume, export, plot), each starting as the user started
llmtune, so that it runs as printed: bin/llmtune names itself in LLMTUNE_PROG (`llmtune` is on the PATH only in an
activated environment), the installed script and `python -m llmtune` are `llmtune`. Torch-free."""

import os
import shlex

PROG = "LLMTUNE_PROG"


def command_line(*words) -> str:
    """`llmtune WORDS...` as the shell reads it (each word quoted where it needs it)."""
    return shlex.join([os.environ.get(PROG, "llmtune"), *(str(word) for word in words)])
