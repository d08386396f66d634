"""The budget section of a prune's (derive's, deploy's) settings (issue 53): one budget of a registered kind
(``edgeprune.budget``: a fraction of the dense model in (0, 1] or an absolute count; a latency budget with its
table). The section holds the values as typed; :func:`edgeprune.budget.make_budget` turns them into a
:class:`~edgeprune.budget.Budget`."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from edgeprune.settings import Section, setting


@dataclasses.dataclass(frozen=True)
class BudgetSection(Section):
    """At most one of ``flops`` / ``params`` / ``latency`` (the latter with ``latency_table``). The help's
    ``{instead}`` is the command's word (prune: " instead of --sparsity"; derive: none)."""

    name: ClassVar[str] = "budget"
    title: ClassVar[str] = "Budget"

    flops: Any = setting(None, "FLOPs budget{instead}: a fraction of the dense model (0.5) or a count "
                         "(2.3G); kept dims are allocated per block and module.", metavar="F", kind="text",
                         essential=True)
    params: Any = setting(None, "Parameter budget{instead}: a fraction (0.5) or a count (20M).",
                          metavar="P", kind="text", essential=True)
    latency: Any = setting(None, "Latency budget{instead}: a fraction of the dense model's latency on "
                           "the --latency-table (0.5) or milliseconds per batch of the table's batch size (12ms).",
                           metavar="F", kind="text", essential=True)
    latency_table: Any = setting(None, "The latency table of --latency (made by `edgeprune latency-table --model M "
                                 "--device PROFILE`).", metavar="FILE", kind="text", essential=True)

    def keywords(self) -> dict[str, Any]:
        """The given budget values as ``edgeprune.budget.make_budget`` keywords (None left out)."""
        return {k: v for k, v in self.items() if v is not None}


__all__ = ["BudgetSection"]
