"""The console-script entry point ``edgeprune`` (``edgeprune.cli.entry:script``, which runs :func:`main`) and
``python -m edgeprune.cli``.

It imports nothing heavy: :func:`main` first makes Ctrl-C (SIGINT) one ``interrupted`` line with
exit 130, then imports the command line (:mod:`edgeprune.cli.main`: torch, timm, ...; seconds)
and runs it. So an interrupt at any moment of a command -- while the modules are still being
imported included -- prints one line, never a traceback (issue 41). Only this module and the light
package ``__init__`` files run before the guard. The points :mod:`edgeprune.phases` reports (``start``,
``imported``, ``done``) are set here, so that a test sends its Ctrl-C at a point the program names, not after a
delay.

While the modules are imported, SIGINT does not raise ``KeyboardInterrupt``: an exception raised
inside the initialisation of a compiled module (numpy's, torch's) can be swallowed (the command
then ran to the end) or leave the module half-initialised (an ``ImportError`` traceback). Nothing
is written yet at that point, so the handler says ``interrupted`` and ends the process at once
(``os._exit(130)``). From the command's start on, SIGINT raises ``KeyboardInterrupt`` again and
:func:`edgeprune.cli.main.main` turns it into the same line after the clean-up of any output
being written.

A process started with SIGINT ignored (a background job of a non-interactive shell, ``nohup``-style
launchers) keeps ignoring it, as Python itself does: :func:`main` installs nothing then, so the
command neither dies from nor reacts to a Ctrl-C its parent chose to ignore (before this, an
interrupt in the first milliseconds was ignored and a later one was not).
"""

from __future__ import annotations

import atexit
import importlib
import os
import signal
import sys
import threading

from edgeprune.phases import reached

#: the exit status of an interrupted command (128 + SIGINT), as the CLI's error handler uses
INTERRUPTED_EXIT = 130


def _interrupted() -> None:
    """Say ``interrupted`` (rank 0 of a torchrun job only) and exit 130, ignoring further Ctrl-C."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while exiting: no traceback
    _say_interrupted()
    sys.exit(INTERRUPTED_EXIT)


def _exit_now(signum, frame) -> None:
    """SIGINT while the command line is imported: one line, exit 130, at once (nothing written yet)."""
    _say_interrupted()
    os._exit(INTERRUPTED_EXIT)


def _say_interrupted() -> None:
    """``interrupted`` on stderr (not on the other ranks of a torchrun job)."""
    try:
        rank_quiet = int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) != 0
    except ValueError:
        rank_quiet = False
    if not rank_quiet:
        try:
            sys.stderr.write("interrupted\n")
            sys.stderr.flush()
        except (OSError, ValueError):  # stderr closed: the exit status says it
            pass


def main(argv: list[str] | None = None) -> None:
    """Run the ``edgeprune`` command line with Ctrl-C guarded from the first instant.

    SIGINT while the CLI's modules are imported: ``interrupted``, exit 130 at once; later it raises
    ``KeyboardInterrupt`` (Python's default handler), which :func:`edgeprune.cli.main.main` (or,
    in the instant before it runs, this function) turns into the same line and status. Once the
    command is over, SIGINT is ignored (the process is exiting with the command's status). A process
    started with SIGINT ignored keeps it ignored throughout (module doc).

    Raises:
        SystemExit: the command's exit status (0, 1, 2, 130, 143).
    """
    # handlers only from the main thread, and not at all for a process started with Ctrl-C ignored (module doc)
    guard = (threading.current_thread() is threading.main_thread()
             and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN)
    try:
        if guard:
            signal.signal(signal.SIGINT, _exit_now)
        reached("start")
        cli_main = importlib.import_module("edgeprune.cli.main")  # the heavy part: torch, timm, ...
        sys.modules["edgeprune.cli"].main = main  # the import bound the submodule to the package's 'main'
        if guard:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        reached("imported")
        cli_main.main(argv)
    except KeyboardInterrupt:
        _interrupted()
    finally:
        if guard:  # the command is over (its outputs are written): Ctrl-C while exiting is ignored
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        reached("done")


def script() -> None:
    """The ``edgeprune`` console script and ``python -m edgeprune.cli``: :func:`main`, with an interrupted
    command's exit status 130 made final.

    After ``interrupted`` was printed and ``SystemExit(130)`` raised, the process was sometimes still
    reported as killed by SIGINT (Python's ``returncode`` -2, not 130): 2 of ~45 trials with the interrupt
    3-4.5 s into a prune on a loaded 2-core box (issue 43); the interpreter's finalization puts SIGINT back to
    its default action when a Python-level handler is installed, and which late path re-raised it was not
    pinned down. So after ``interrupted`` this runs the exit handlers (temporary folders' finalizers
    included), flushes the standard streams and leaves with ``os._exit(130)`` (0 of 30 trials since). Shells
    report both as 130; a parent that waits on the process now always sees exit status 130. In-process
    callers use :func:`main` (a ``SystemExit``).

    Raises:
        SystemExit: the command's exit status, except 130 (the process ends).
    """
    try:
        main()
    except SystemExit as end:
        if end.code != INTERRUPTED_EXIT:
            raise
    else:
        return
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or replaced: the exit status says it
            pass
    os._exit(INTERRUPTED_EXIT)


__all__ = ["main", "script", "INTERRUPTED_EXIT"]
