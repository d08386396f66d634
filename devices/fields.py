"""Typed reading of one TOML table of a device profile, with one-line errors naming the field.

:class:`Section` reads strings, integers, booleans and lists from a table, refuses unknown keys
(with a did-you-mean hint) and raises :class:`~devices.profile.ProfileError` such as
``orin-nx.toml: build.precision must be one of fp16, fp32, int8 (got 'fp8')``;
:func:`parse_compute_capability` and :func:`expand_path` read the two values that are more than a
TOML type (a ``major.minor`` version, a path).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Mapping

from edgeprune.errors import UserError


class ProfileError(UserError):
    """A device profile that cannot be loaded or has a bad field."""


class Section:
    """Reads typed fields from one TOML table and remembers which keys were consumed."""

    def __init__(self, label: str, prefix: str, table: Mapping[str, Any], known: tuple[str, ...]):
        self.label = label
        self.prefix = prefix
        self.table = table
        self.known = known
        self.seen: set[str] = set()
        extra = [k for k in table if k not in known]
        if extra:
            close = difflib.get_close_matches(extra[0], known, n=1)
            hint = f"did you mean {self.field(close[0])}? " if close else ""
            raise ProfileError(f"{label}: unknown key {self.field(extra[0])} "
                               f"({hint}known here: {', '.join(known)})")

    def field(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def fail(self, key: str, what: str) -> ProfileError:
        return ProfileError(f"{self.label}: {self.field(key)} {what}")

    def _get(self, key: str, default: Any, required: bool) -> Any:
        self.seen.add(key)
        if key not in self.table:
            if required:
                raise self.fail(key, "is required")
            return default
        return self.table[key]

    def string(self, key: str, default: str | None = None, *, required: bool = False,
               choices: tuple[str, ...] | None = None) -> str | None:
        v = self._get(key, default, required)
        if v is None:
            return None
        if not isinstance(v, str):
            raise self.fail(key, f"must be a string (got {v!r})")
        if choices is not None and v not in choices:
            raise self.fail(key, f"must be one of {', '.join(choices)} (got {v!r})")
        return v

    def integer(self, key: str, default: int | None = None, *, required: bool = False,
                lo: int | None = None, hi: int | None = None) -> int:
        v = self._get(key, default, required)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(key, f"must be an integer (got {v!r})")
        if lo is not None and hi is not None and not lo <= v <= hi:
            raise self.fail(key, f"must be between {lo} and {hi} (got {v})")
        if lo is not None and v < lo:
            raise self.fail(key, f"must be >= {lo} (got {v})")
        return v

    def boolean(self, key: str, default: bool) -> bool:
        v = self._get(key, default, False)
        if not isinstance(v, bool):
            raise self.fail(key, f"must be true or false (got {v!r})")
        return v

    def int_list(self, key: str, default: list[int] | None = None, *, required: bool = False,
                 lo: int = 1) -> tuple[int, ...]:
        v = self._get(key, default, required)
        if isinstance(v, int) and not isinstance(v, bool):
            v = [v]
        if not isinstance(v, list) or not v:
            raise self.fail(key, f"must be a non-empty list of integers (got {v!r})")
        for item in v:
            if isinstance(item, bool) or not isinstance(item, int) or item < lo:
                raise self.fail(key, f"must contain integers >= {lo} (got {item!r})")
        return tuple(v)

    def str_list(self, key: str) -> tuple[str, ...]:
        v = self._get(key, [], False)
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise self.fail(key, f"must be a list of strings (got {v!r})")
        return tuple(v)

    def table_(self, key: str, *, required: bool = False) -> Mapping[str, Any] | None:
        v = self._get(key, None, required)
        if v is None:
            return None
        if not isinstance(v, dict):
            raise self.fail(key, f"must be a table (got {v!r})")
        return v


def parse_compute_capability(value: Any, label: str, field: str = "device.compute_capability"
                             ) -> tuple[int, int]:
    """``"8.6"`` (or ``8.6``, or ``[8, 6]``) -> ``(8, 6)``."""
    text: str
    if isinstance(value, list) and len(value) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                           for x in value):
        return (int(value[0]), int(value[1]))
    if isinstance(value, float):
        text = repr(value)
    elif isinstance(value, str):
        text = value.strip()
    else:
        raise ProfileError(f"{label}: {field} must be a string like \"8.6\" (got {value!r})")
    parts = text.split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ProfileError(f"{label}: {field} must look like \"8.6\" (major.minor) (got {value!r})")
    return (int(parts[0]), int(parts[1]))


def expand_path(text: str, base_dir: Path | None) -> Path:
    """Expand ``~`` and ``$VARS``; a relative path is taken relative to ``base_dir``."""
    p = Path(os.path.expandvars(os.path.expanduser(text)))
    if not p.is_absolute() and base_dir is not None:
        p = base_dir / p
    return p


__all__ = ["ProfileError", "Section", "expand_path", "parse_compute_capability"]
