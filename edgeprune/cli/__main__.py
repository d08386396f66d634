"""``python -m edgeprune.cli``: the same as the ``edgeprune`` command (Ctrl-C guarded from the
start; :func:`edgeprune.cli.entry.script`)."""

from edgeprune.cli.entry import script

script()
