"""``python -m edgeprune.cli``: the same as the ``edgeprune`` command."""

from edgeprune.cli.main import main

main()
