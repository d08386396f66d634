"""The ``tokens_merge`` stage (issue 44): training-free token merging (ToMe, ``edgeprune.tokens``) after the width
stages, before the output correction (which then corrects the merge's output shift too).

Checked before any pass: the model fits (a class-token or average-pooled classifier ViT, or a network with a ViT
inside, which merges inside each block and unmerges: ``edgeprune.tokens.unmerge``) and every block can merge
its r of the tokens it receives (``edgeprune.tokens.apply.merge_plan``; a class-token last block merges nothing).
The run record's ``tokens_merge`` entry (the schedule asked, r per block, the tokens each block receives and the
tokens after the last block) is what ``load_run`` re-applies. ``tokens_merge=0`` (or all zeros) leaves the model
as the width stages made it.
"""

from __future__ import annotations

from edgeprune.anatomy import find_anatomy
from edgeprune.pruning import stages as _stages  # noqa: F401  (the built-in stages first: this one goes after them)
from edgeprune.pruning.stage import PruneState, Stage, register_stage
from edgeprune.tokens.apply import apply_token_merge, merge_plan, unmerges
from edgeprune.tokens.schedule import parse_tokens_merge


@register_stage("tokens_merge", after="class_token_block")
class TokensMerge(Stage):
    """Merges r tokens per block (the config's ``tokens_merge`` schedule) in the pruned model."""

    def check(self, state: PruneState) -> None:
        value = parse_tokens_merge(state.config.tokens_merge)
        if value is None:
            return
        class_token_last = bool(state.extra.get("last_block")) or state.anatomy.blocks[-1].query_tokens is not None
        state.extra["tokens_merge"] = (value, *merge_plan(state.anatomy.model, value, class_token_last))

    def run(self, state: PruneState) -> None:
        if "tokens_merge" not in state.extra:
            return
        value, r, tokens = state.extra["tokens_merge"]
        apply_token_merge(state.anatomy.model, r)
        state.anatomy = find_anatomy(state.model)
        last = state.anatomy.blocks[-1]
        dense = unmerges(state.model)
        out = last.query_tokens if last.query_tokens is not None else tokens[-1] - (0 if dense else r[-1])
        state.record["tokens_merge"] = {"schedule": list(value) if isinstance(value, tuple) else value, "r": r,
                                        "tokens": tokens, "output_tokens": int(out),
                                        **({"unmerge": True} if dense else {})}
