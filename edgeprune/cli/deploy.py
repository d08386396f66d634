"""The former home of ``edgeprune export`` / ``edgeprune verify`` (issue 42), kept for imports: the commands live in
:mod:`edgeprune.cli.export` and :mod:`edgeprune.cli.verify` (issue 53: their options generated from declared
settings), ``edgeprune deploy`` in :mod:`edgeprune.cli.deploy_cmd`."""

from __future__ import annotations

from edgeprune.cli.export import export_cmd
from edgeprune.cli.verify import verify_cmd

__all__ = ["export_cmd", "verify_cmd"]
