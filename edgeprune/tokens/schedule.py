"""How many tokens each block merges (``--tokens-merge R``, ``CorpConfig.tokens_merge``): the schedule's forms, its
per-block r and the token counts it gives.

Forms (the config keeps the canonical one :func:`parse_tokens_merge` returns):

* ``R`` (an int >= 0) -- r = R in every block (ToMe's constant schedule, Bolya et al., ICLR 2023, §3);
* ``"r0,r1,..."`` or a list -- one r per block;
* ``"decreasing:R"`` -- ToMe's decreasing schedule: r falls linearly from 2R in the first block to 0 in the last,
  about the same total as R per block but more merging early, where tokens are most redundant (ToMe §4.1 "Merging
  schedule"; the official code's ``parse_r(num_layers, (R, -1))``: ``int(2R - 2R i / (L - 1))``).

A block can merge at most ``(N - prefix) // 2`` of the N tokens it receives (the size of set B); N counts the
earlier blocks' merges. A class-token last block (``--last-block cls``) merges nothing: it computes only the class
token, which a merge never changes, so its r is 0 whatever the schedule says.
"""

from __future__ import annotations

from typing import Any

from edgeprune.errors import UserError
from edgeprune.tokens.merge import split_sizes

OPTION = "--tokens-merge"
DECREASING = "decreasing"
#: ``tokens_merge`` value that lets the budget choose the schedule (``edgeprune.pruning.tokens_auto``)
AUTO = "auto"


def is_tokens_auto(cfg: Any) -> bool:
    """Whether ``cfg.tokens_merge`` asks the budget to choose the schedule (``"auto"``)."""
    return isinstance(cfg.tokens_merge, str) and cfg.tokens_merge == AUTO


def _int(text: Any, what: str) -> int:
    if isinstance(text, bool):
        raise UserError(f"{OPTION}: {what} must be an integer >= 0, got {text!r}")
    try:
        value = int(str(text).strip()) if not isinstance(text, int) else text
    except ValueError:
        raise UserError(f"{OPTION}: {what} must be an integer >= 0, got {str(text).strip()!r} "
                        f"(forms: R, r0,r1,... one per block, {DECREASING}:R)") from None
    if value < 0:
        raise UserError(f"{OPTION}: {what} must be >= 0 (tokens merged away), got {value}")
    return value


def parse_tokens_merge(value: Any) -> int | tuple[int, ...] | str | None:
    """The canonical form of a schedule: None (no merging), an int, a tuple of ints or ``"decreasing:R"``; or
    ``"auto"`` (the budget chooses among candidate schedules: ``edgeprune.pruning.tokens_auto``).

    Accepts those forms, a list, and the command line's strings (``"8"``, ``"8,8,0"``, ``"decreasing:8"``, ``"auto"``).

    Raises:
        UserError: a negative or non-integer r, an empty list, an unknown form.
    """
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        if not value:
            raise UserError(f"{OPTION}: an empty list (give one r per block)")
        return tuple(_int(v, f"r of block {i}") for i, v in enumerate(value))
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == AUTO:
            return AUTO
        if text.lower().startswith(DECREASING):
            rest = text[len(DECREASING):]
            if not rest.startswith(":"):
                raise UserError(f"{OPTION} {text!r}: the decreasing schedule needs its R ({DECREASING}:R, e.g. "
                                f"{DECREASING}:8: r falls from 2R to 0)")
            return f"{DECREASING}:{_int(rest[1:], 'R')}"
        if "," in text:
            return parse_tokens_merge(text.split(","))
        return _int(text, "R")
    return _int(value, "R")


def schedule_r(value: Any, num_blocks: int) -> list[int]:
    """The per-block r of a schedule (module doc) for a model of ``num_blocks`` blocks.

    Raises:
        UserError: a bad value, or a list whose length is not the number of blocks.
    """
    value = parse_tokens_merge(value)
    if value is None:
        return [0] * num_blocks
    if value == AUTO:
        raise UserError(f"{OPTION} auto is chosen per candidate schedule by edgeprune.prune "
                        "(edgeprune.pruning.tokens_auto); this step takes a fixed schedule")
    if isinstance(value, tuple):
        if len(value) != num_blocks:
            raise UserError(f"{OPTION} lists {len(value)} values for a model of {num_blocks} blocks "
                            "(give one per block, or one number for every block)")
        return list(value)
    if isinstance(value, str):  # ToMe's parse_r with inflection -1
        r = int(value.split(":")[1])
        if num_blocks == 1:
            return [r]
        step = -2 * r / (num_blocks - 1)
        return [int(2 * r + step * i) for i in range(num_blocks)]
    return [int(value)] * num_blocks


def token_counts(r: list[int], num_tokens: int, num_prefix: int, unmerge: bool = False) -> list[int]:
    """The tokens each block receives under the per-block ``r`` (block i merges after its attention: block i + 1
    receives ``tokens[i] - r[i]``; with ``unmerge``, :mod:`edgeprune.tokens.unmerge`, every block receives all
    ``num_tokens``).

    Raises:
        UserError: a block asked to merge more than ``(N - prefix) // 2`` of its N tokens, named.
    """
    out, n = [], int(num_tokens)
    after = "" if unmerge else " after the earlier blocks' merges"
    for i, ri in enumerate(r):
        most = split_sizes(n, num_prefix)[1]
        if ri > most:
            raise UserError(f"{OPTION}: block {i} would merge {ri} tokens but can merge at most {most} "
                            f"((N - prefix) // 2 with N = {n} tokens{after}, {num_prefix} prefix); lower r")
        out.append(n)
        n -= 0 if unmerge else ri
    return out


def plan_merges(value: Any, num_blocks: int, num_tokens: int, num_prefix: int,
                class_token_last: bool = False, unmerge: bool = False) -> tuple[list[int], list[int]]:
    """``(r per block, tokens each block receives)`` of a schedule on a model of ``num_blocks`` blocks and
    ``num_tokens`` tokens (``num_prefix`` of them never merged); a class-token last block's r is 0 (module doc);
    ``unmerge``: the blocks merge inside and unmerge (:mod:`edgeprune.tokens.unmerge`), each receives all tokens.

    Raises:
        UserError: as :func:`schedule_r` and :func:`token_counts`.
    """
    r = schedule_r(value, num_blocks)
    if class_token_last:
        r[-1] = 0
    return r, token_counts(r, num_tokens, num_prefix, unmerge)


def parse_candidates(value: Any) -> tuple | None:
    """``CorpConfig.tokens_candidates``: None (the model's default candidates, ``edgeprune.pruning.tokens_auto``) or
    a non-empty list of schedules in any form of :func:`parse_tokens_merge` but ``"auto"`` (a per-block schedule as
    a list or tuple), returned in their canonical forms.

    Raises:
        UserError: a string, an empty list, a bad schedule (one line naming it).
    """
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not value:
        raise UserError(f"tokens candidates must be a non-empty list of schedules (R, [r0, r1, ...] or "
                        f"'{DECREASING}:R'), got {value!r}")
    out = []
    for v in value:
        s = parse_tokens_merge(v)
        if s is None or s == AUTO:
            raise UserError(f"tokens candidates: {v!r} is not a schedule (R, [r0, r1, ...] or '{DECREASING}:R')")
        out.append(s)
    return tuple(out)
