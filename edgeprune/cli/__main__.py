"""``python -m edgeprune.cli``: the same as the ``edgeprune`` command (Ctrl-C guarded from the start)."""

from edgeprune.cli.entry import main

main()
