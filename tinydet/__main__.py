"""`python -m tinydet`, and the `tinydet` console script (pyproject.toml's entry point): `run`."""

import os
import signal
import threading

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


def _watch(sigs: set, done: threading.Event) -> None:
    """While the imports run with `sigs` blocked: take any of them that comes, and exit."""
    while not done.is_set():
        info = signal.sigtimedwait(sigs, 0.05)
        if info is not None:
            _early_exit(info.si_signo, None)


def run():
    """The `tinydet` command: the signal handlers first, then the imports."""
    # Only over the defaults: a signal ignored from the start (nohup, `cmd &`) stays ignored.
    sigs = {s for s in _EARLY if signal.getsignal(s) in (signal.default_int_handler, signal.SIG_DFL)}
    for sig in sigs:
        signal.signal(sig, _early_exit)
    if not sigs or not hasattr(signal, "sigtimedwait"):  # Windows and macOS: the handlers alone
        from .cli import main

        return main()
    # A signal sent to the process goes to any thread that does not block it, and the handler above
    # runs in the main thread only when that thread next runs Python: one taken by another thread
    # leaves the main thread's sleep or read running (seen: 1 in 50 runs under load, after the
    # imports, with NumPy's BLAS threads beside it). The imports start such threads, and a thread
    # starts with its creator's signal mask: they are made with the signals blocked, so that the main
    # thread stays the one that takes them. Meanwhile a watcher takes what comes.
    done = threading.Event()
    watcher = threading.Thread(target=_watch, args=(sigs, done), name="tinydet-start", daemon=True)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    watcher.start()
    try:
        from .cli import main
    finally:
        done.set()
        watcher.join()
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # one that came since is taken here, by the handler
    main()


if __name__ == "__main__":
    run()
