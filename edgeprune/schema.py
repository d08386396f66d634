"""A small declarative schema for the JSON files edgeprune reads back (issue 41): a run record
(:mod:`edgeprune.record_schema`) and a latency table (:mod:`edgeprune.latency.schema`).

A file a user can copy, edit or damage is checked once, where it is loaded, against one schema of
nested nodes; the first field that does not fit becomes one :class:`~edgeprune.errors.UserError`
line naming the file and the field (``"allocation.blocks[0].dims.mlp"``), what it must be and what
it is -- never a ``KeyError`` / ``TypeError`` / ``ZeroDivisionError`` from a reader later.

Nodes: :class:`Int`, :class:`Num` (finite, with bounds), :class:`Str`, :class:`Bool`,
:class:`Any` (anything JSON, non-finite numbers refused), :class:`ListOf`, :class:`MapOf` (an
object with free keys), :class:`Obj` (named fields, required or optional), :class:`OneOf`;
``nullable=True`` on any node accepts ``null``. JSON numbers ``NaN`` / ``Infinity`` (which
Python's ``json`` reads) are refused by every node.
"""

from __future__ import annotations

import math
from typing import Any as _Any, Callable

from edgeprune.errors import UserError

__all__ = ["Node", "Int", "Num", "Str", "Bool", "Any", "ListOf", "MapOf", "Obj", "OneOf", "Req", "SchemaError",
           "check", "shown"]


class SchemaError(UserError):
    """A field does not fit its schema: ``field`` (dotted path) and ``want`` / ``got`` for the message."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"field {field!r} {problem}")
        self.field, self.problem = field, problem


def shown(value: _Any, limit: int = 40) -> str:
    """A JSON value as a user wrote it (``null``, ``true``, ``"x"``, ``NaN``), cut to ``limit``."""
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, float) and not math.isfinite(value):
        text = "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    elif isinstance(value, str):
        text = '"' + value + '"'
    elif isinstance(value, dict):
        text = "an object" if value else "{}"
    elif isinstance(value, list):
        text = "a list" if value else "[]"
    else:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_int(v: _Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: _Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class Node:
    """A schema node: ``want`` says what the value must be (the message); ``nullable`` accepts null."""

    want = "a value"

    def __init__(self, *, nullable: bool = False, want: str | None = None) -> None:
        self.nullable = nullable
        if want is not None:
            self.want = want

    def wants(self) -> str:
        return self.want + (" or null" if self.nullable else "")

    def check(self, value: _Any, field: str) -> None:
        """Raise :class:`SchemaError` naming ``field`` unless ``value`` fits."""
        if value is None:
            if not self.nullable:
                raise SchemaError(field, f"must be {self.wants()}, got null")
            return
        if not self.fits(value, field):
            raise SchemaError(field, f"must be {self.wants()}, got {shown(value)}")

    def fits(self, value: _Any, field: str) -> bool:  # overridden; containers check their items too
        return True


class Int(Node):
    """An integer (not a bool) in ``[min, max]``."""

    def __init__(self, min: int | None = None, max: int | None = None, **kw) -> None:
        self.min, self.max = min, max
        if "want" not in kw:
            kw["want"] = ("a positive integer" if min == 1 and max is None else "an integer >= 0" if min == 0
                          and max is None else "an integer" + (f" >= {min}" if min is not None else "")
                          + (f" <= {max}" if max is not None else ""))
        super().__init__(**kw)

    def fits(self, v, field) -> bool:
        return _is_int(v) and (self.min is None or v >= self.min) and (self.max is None or v <= self.max)


class Num(Node):
    """A finite number (int or float, not a bool) above ``gt`` / at least ``ge`` / at most ``le``."""

    def __init__(self, *, gt: float | None = None, ge: float | None = None, le: float | None = None, **kw) -> None:
        self.gt, self.ge, self.le = gt, ge, le
        if "want" not in kw:
            kw["want"] = ("a positive finite number" if gt == 0 and ge is None and le is None else
                          "a finite number" + (f" > {gt:g}" if gt is not None else "")
                          + (f" >= {ge:g}" if ge is not None else "") + (f" <= {le:g}" if le is not None else ""))
        super().__init__(**kw)

    def fits(self, v, field) -> bool:
        return (_is_num(v) and math.isfinite(v) and (self.gt is None or v > self.gt)
                and (self.ge is None or v >= self.ge) and (self.le is None or v <= self.le))


class Str(Node):
    """A string (``nonempty``: with a non-blank character; ``choices``: one of them)."""

    def __init__(self, *, nonempty: bool = False, choices: tuple | None = None, **kw) -> None:
        self.nonempty, self.choices = nonempty, choices
        if "want" not in kw:
            kw["want"] = ("one of " + ", ".join(f'"{c}"' for c in choices) if choices
                          else "a non-empty string" if nonempty else "a string")
        super().__init__(**kw)

    def fits(self, v, field) -> bool:
        return (isinstance(v, str) and (not self.nonempty or v.strip() != "")
                and (self.choices is None or v in self.choices))


class Bool(Node):
    """``true`` or ``false``."""

    want = "true or false"

    def fits(self, v, field) -> bool:
        return isinstance(v, bool)


class Any(Node):
    """Any JSON value; numbers inside (at any depth) must be finite."""

    want = "a JSON value with finite numbers"

    def fits(self, v, field) -> bool:
        _finite_everywhere(v, field)
        return True


def _finite_everywhere(v: _Any, field: str) -> None:
    if isinstance(v, float) and not math.isfinite(v):
        raise SchemaError(field, f"must be a finite number, got {shown(v)}")
    if isinstance(v, dict):
        for k, x in v.items():
            _finite_everywhere(x, f"{field}.{k}")
    elif isinstance(v, list):
        for i, x in enumerate(v):
            _finite_everywhere(x, f"{field}[{i}]")


class ListOf(Node):
    """A list of ``item`` with ``min_len`` <= length (<= ``max_len``); ``increasing``: strictly ascending."""

    def __init__(self, item: Node, *, min_len: int = 0, max_len: int | None = None, increasing: bool = False,
                 **kw) -> None:
        self.item, self.min_len, self.max_len, self.increasing = item, min_len, max_len, increasing
        if "want" not in kw:
            size = ("" if not min_len and max_len is None else f" of {min_len}" if min_len == max_len
                    else " (non-empty)" if min_len == 1 and max_len is None else f" of >= {min_len}")
            kw["want"] = f"a{' strictly increasing' if increasing else ''} list{size} of {item.want.split(' or ')[0]}"
        super().__init__(**kw)

    def fits(self, v, field) -> bool:
        if not isinstance(v, list) or len(v) < self.min_len or (self.max_len is not None and len(v) > self.max_len):
            return False
        for i, x in enumerate(v):
            self.item.check(x, f"{field}[{i}]")
        return not self.increasing or all(a < b for a, b in zip(v, v[1:]))


class MapOf(Node):
    """An object with free keys, each value an ``item``."""

    def __init__(self, item: Node, **kw) -> None:
        self.item = item
        kw.setdefault("want", f"an object of {item.want.split(' or ')[0]} values")
        super().__init__(**kw)

    def fits(self, v, field) -> bool:
        if not isinstance(v, dict):
            return False
        for k, x in v.items():
            self.item.check(x, f"{field}.{k}")
        return True


class Req:
    """A required field of an :class:`Obj` (``Obj({"name": Req(Str())})``); plain nodes are optional."""

    def __init__(self, node: Node) -> None:
        self.node = node


class Obj(Node):
    """An object with named fields (``Req(node)``: must be present; a plain node: may be absent).

    Keys not named are allowed and not checked (informational entries). ``then``: a further check
    of the whole object (consistency between fields), called after the fields.
    """

    want = "an object"

    def __init__(self, fields: dict[str, Node | Req], *, then: Callable[[dict, str], None] | None = None,
                 **kw) -> None:
        self.fields, self.then = fields, then
        super().__init__(**kw)

    def fits(self, v, field) -> bool:
        if not isinstance(v, dict):
            return False
        for name, spec in self.fields.items():
            sub = f"{field}.{name}" if field else name
            node = spec.node if isinstance(spec, Req) else spec
            if name not in v:
                if isinstance(spec, Req):
                    raise SchemaError(sub, "is missing")
                continue
            node.check(v[name], sub)
        if self.then is not None:
            self.then(v, field)
        return True


class OneOf(Node):
    """The first of ``options`` that fits (their ``want`` joined with "or" in the message)."""

    def __init__(self, *options: Node, **kw) -> None:
        self.options = options
        kw.setdefault("want", " or ".join(o.want for o in options))
        super().__init__(**kw)

    def fits(self, v, field) -> bool:
        for o in self.options:
            try:
                o.check(v, field)
                return True
            except SchemaError:
                continue
        return False


def check(schema: Node, value: _Any, what: str, hint: str) -> _Any:
    """``value`` if it fits ``schema``; else one :class:`~edgeprune.errors.UserError` line.

    Args:
        schema: the root node.
        value: the parsed JSON document.
        what: the file, for the message (``"runs/x/run.json"``).
        hint: how to get a good file, in the message's parentheses.

    Raises:
        UserError: ``"<what>: field 'a.b[0]' must be <want>, got <value> (<hint>)"``.
    """
    try:
        schema.check(value, "")
    except SchemaError as err:
        raise UserError(f"{what}: field {err.field!r} {err.problem} ({hint})") from None
    return value
