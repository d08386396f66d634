"""Errors that the CLI reports as one line (no traceback) with a non-zero exit."""


class UserError(Exception):
    """A mistake in the user's input: bad option, missing file, unknown model, ...

    The CLI prints ``error: <message>`` and exits with status 2.
    """
