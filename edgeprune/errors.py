"""Errors that the CLI reports as one line (no traceback) with a non-zero exit.

Every library function raises one of these for anything a user can fix; ``edgeprune.cli.main``
is the single place that turns them into ``error: <what> (<how to fix>)`` on stderr:

* :class:`UserError` -- a mistake in the user's input (bad option, missing file, unknown model):
  exit status 2 (the usage-error status of click and of POSIX tools).
* :class:`RuntimeFault` -- the environment failed while doing valid work (disk full, read-only
  output, a backend that is not installed, no CUDA device): exit status 1.

Messages are one line: what went wrong, then in parentheses how to fix it where that is known.
"""


class UserError(Exception):
    """A mistake in the user's input: bad option, missing file, unknown model, ...

    The CLI prints ``error: <message>`` and exits with status 2.
    """

    exit_code = 2


class RuntimeFault(UserError):
    """The environment failed during valid work: no space left, read-only output, missing backend.

    A subclass of :class:`UserError` so that code catching user-facing errors catches both; the CLI
    prints ``error: <message>`` and exits with status 1.
    """

    exit_code = 1
