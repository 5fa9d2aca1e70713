"""Start a process as a terminal's foreground job is started: SIGINT and SIGTERM at their defaults and
unblocked, whatever the test run itself has.

A child inherits ignored signals and the signal mask across exec. A test run started in the background
of a script (`pytest &`, or under a supervisor that ignores SIGINT) ignores SIGINT, and so, rightly,
does every `tinydet` it starts: a background job is not for the terminal's Ctrl-C (tinydet/__main__.py).
A test that sends a signal must not depend on how its runner was started, so the processes it signals
begin with `FOREGROUND`: a Python that sets both signals to their defaults, empties the mask and
execs the command (same pid), instead of a preexec_fn in a process that has threads."""

from __future__ import annotations

import sys

_RESET = ("import os, signal, sys\n"
          "for s in (signal.SIGINT, signal.SIGTERM):\n"
          "    signal.signal(s, signal.SIG_DFL)\n"
          "signal.pthread_sigmask(signal.SIG_SETMASK, [])\n"
          "os.execv(sys.argv[1], sys.argv[1:])\n")

FOREGROUND = [sys.executable, "-c", _RESET]


def tinydet_argv(*args) -> list[str]:
    """`python -m tinydet ARGS`, started in the foreground's signal state."""
    return [*FOREGROUND, sys.executable, "-m", "tinydet", *map(str, args)]
