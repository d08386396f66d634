"""The token-merging section of a prune's settings (issue 53): the schedule, parsed once into its canonical form
(``edgeprune.tokens.schedule``: an int, a tuple of per-block r, ``"decreasing:R"`` or ``"auto"``)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from edgeprune.settings import Section, setting
from edgeprune.tokens.schedule import parse_candidates, parse_tokens_merge


@dataclasses.dataclass(frozen=True)
class TokensSection(Section):
    """ToMe token merging after the width stages (docs/tokens.md); its fit with the budget is checked with the rest
    of the prune's settings (``edgeprune.pruning.config.check_tokens_settings``)."""

    name: ClassVar[str] = "tokens"
    title: ClassVar[str] = "Token merging"

    tokens_merge: Any = setting(
        None, "Token merging after the width pruning (ToMe, training-free, docs/tokens.md): R tokens merged per "
        "block, a list r0,r1,... (one per block) or decreasing:R (r falls from 2R to 0); fixed shapes, exports to "
        "ONNX / TensorRT. auto (with --latency and a table with a token axis): the schedule with the lowest output "
        "error on the check images among a few candidates (0 one of them), one prune per candidate.",
        metavar="R", kind="text", shown_default="off")
    tokens_candidates: tuple | None = setting(None, "The schedules tokens auto tries (None: the model's default).",
                                              cli=False)

    def validate(self) -> "TokensSection":
        """The section with the schedule and the candidates in their canonical forms (parsed once).

        Raises:
            UserError: a malformed schedule (``edgeprune.tokens.schedule.parse_tokens_merge``).
        """
        merge, cands = parse_tokens_merge(self.tokens_merge), parse_candidates(self.tokens_candidates)
        if merge == self.tokens_merge and cands == self.tokens_candidates:
            return self
        return self.replace(tokens_merge=merge, tokens_candidates=cands)


__all__ = ["TokensSection"]
