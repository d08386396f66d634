"""The points a command reports as it passes them, for tests and tools that must act at a known point of a run.

A Ctrl-C "after the model loaded" or a SIGTERM "while the output is written" sent after a wall-clock delay tests the
machine's speed, not the program: on a loaded box the delay lands elsewhere (issue 52: a SIGINT sent 0.1 s after the
start landed in CPython's own start-up). Instead the program names the points it reaches, and a caller that set
``EDGEPRUNE_PHASES`` acts on them:

* ``EDGEPRUNE_PHASES="W"``: at each point the command writes ``<name>\\n`` to the open file descriptor ``W``;
* ``EDGEPRUNE_PHASES="W:R"``: it also waits, after each line, for one byte on descriptor ``R`` before it goes on (a
  handshake: the caller signals the process while it stands exactly at that point). End of file on ``R`` ends the
  waiting for the rest of the run; a descriptor that cannot be written ends the reporting.

The points, in the order a ``prune`` passes them (other commands pass the ones they have):

======================  ========================================================================================
``start``               the console script's Ctrl-C guard is installed; the command line is not imported yet
``imported``            the command line is imported; the command is about to parse its arguments
``checked``             every pruning stage checked its settings; nothing expensive has run
``stage <name>``        pruning stage ``<name>`` is about to run (``stage corp``, ``stage output_correction``, ...)
``saving``              an output folder is fully written in its temporary folder, not yet renamed into place
``done``                the command is over (its outputs are in place); Ctrl-C is ignored from here on
======================  ========================================================================================

The window before the interpreter runs any of edgeprune's code (CPython's own start-up, ``site`` and the editable
install's path finder) is out of the program's reach: an interrupt there is Python's to report, and no point names it.

The variable is removed from the environment when first read, so processes the command starts do not inherit it
(their descriptors of the same numbers are other files). Off (the default), :func:`reached` costs one dictionary
look-up.
"""

from __future__ import annotations

import os

#: the environment variable that turns the reports on
ENV_VAR = "EDGEPRUNE_PHASES"

_UNREAD = object()
_channel: object | tuple[int, int | None] | None = _UNREAD


def _open() -> tuple[int, int | None] | None:
    global _channel
    if _channel is _UNREAD:
        raw = os.environ.pop(ENV_VAR, None)
        _channel = None
        if raw:
            try:
                w, _, r = raw.partition(":")
                _channel = (int(w), int(r) if r else None)
            except ValueError:
                _channel = None
    return _channel  # type: ignore[return-value]


def reached(name: str) -> None:
    """Report that the command reached point ``name`` (module doc) and, with a handshake descriptor, wait for the
    caller's byte. A no-op unless ``EDGEPRUNE_PHASES`` was set when the process started.

    A signal the caller sends while this waits is handled here, at this point: ``KeyboardInterrupt`` (or the
    handler's own exit) is raised out of this call as it would be out of the code that follows.

    Raises:
        nothing of its own: a descriptor that cannot be written or read ends the reporting quietly.
    """
    global _channel
    channel = _open()
    if channel is None:
        return
    w, r = channel  # type: ignore[misc]
    try:
        os.write(w, f"{name}\n".encode())
    except OSError:
        _channel = None
        return
    if r is not None:
        try:
            got = os.read(r, 1)
        except OSError:
            got = b""
        if not got:
            _channel = (w, None)


__all__ = ["ENV_VAR", "reached"]
