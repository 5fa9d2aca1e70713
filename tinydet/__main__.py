"""`python -m tinydet`, and the `tinydet` console script (pyproject.toml's entry point): `run`."""

import os
import signal

# Outside a command's own handling (cli.common.cli_errors, which puts these back when the command
# ends), Ctrl-C and SIGTERM end the process at once with cli_errors' line and status: importing NumPy
# and numba takes about a second, click parses after that, and the defaults there would be a
# KeyboardInterrupt traceback (or click's "Aborted!", exit 1) and a silent death. os._exit: nothing
# needs cleaning up yet, and no library's `except BaseException` around an import can swallow it.
_EARLY = {signal.SIGINT: (130, b"\ninterrupted\n"), signal.SIGTERM: (143, b"\nterminated\n")}


def _early_exit(signum, frame):
    code, line = _EARLY[signum]
    os.write(2, line)
    os._exit(code)


def run():
    """The `tinydet` command: the signal handlers first, then the imports."""
    for sig in _EARLY:
        # Only over the defaults: a signal ignored from the start (nohup, `cmd &`) stays ignored.
        if signal.getsignal(sig) in (signal.default_int_handler, signal.SIG_DFL):
            signal.signal(sig, _early_exit)
    from .cli import main

    main()


if __name__ == "__main__":
    run()
