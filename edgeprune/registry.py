"""One registry implementation for every kind of named plug-in (issue 53; modelled on timm's ``_registry``).

Each kind -- criteria, Q/K solvers, prune stages, zoo models, budget kinds, timing backends, weight
roundings, quantization recipes, runner backends -- is one :class:`Registry` instance in the module that
owns the kind, with that module's ``register_*`` / ``get_*`` functions as one-line wrappers::

    SOLVERS: Registry[QKSolverEntry] = Registry("Q/K solver")
    SOLVERS.register("direct", entry)           # ValueError on a duplicate unless replace=True
    SOLVERS.get("nope")                         # UserError: unknown Q/K solver 'nope', known: direct

Names keep their registration order (``names()``, iteration, the known list of the error). A duplicate
name is a programming error (:class:`ValueError`); an unknown name in :meth:`Registry.get` is the user's
(:class:`~edgeprune.errors.UserError`, one line). No module keeps a registry as a bare dict
(``tests/test_registry.py`` fails on one).
"""

from __future__ import annotations

from typing import Callable, Generic, Iterable, Iterator, TypeVar

from edgeprune.errors import UserError

T = TypeVar("T")
D = TypeVar("D")


class Registry(Generic[T]):
    """Names -> objects of one kind (``kind``: the word of the errors, e.g. ``"backend"``)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str, obj: T, *, replace: bool = False) -> T:
        """Add ``obj`` as ``name`` and return it; with ``replace`` an existing entry is replaced in place
        (its position in the order kept).

        Raises:
            ValueError: an empty or non-string ``name``; ``name`` already registered and not ``replace``.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} needs a non-empty name, got {name!r}")
        if name in self._entries and not replace:
            raise ValueError(f"{self.kind} {name!r} is already registered (unregister it first, or replace=True)")
        self._entries[name] = obj
        return obj

    def decorator(self, name: str, *, replace: bool = False) -> Callable[[D], D]:
        """``@registry.decorator("name")``: register the decorated object itself and return it unchanged.

        Raises:
            ValueError: as :meth:`register`, when the decorator is applied.
        """
        def deco(obj: D) -> D:
            self.register(name, obj, replace=replace)  # type: ignore[arg-type]
            return obj
        return deco

    def unregister(self, name: str, *, missing_ok: bool = False) -> None:
        """Remove ``name`` (for tests and experiments that register a toy and take it away again).

        Raises:
            ValueError: ``name`` is not registered and not ``missing_ok``.
        """
        if name not in self._entries:
            if missing_ok:
                return
            raise ValueError(f"{self.kind} {name!r} is not registered, cannot unregister it")
        del self._entries[name]

    def unknown(self, name: object, known: Iterable[str] | None = None, kind: str | None = None) -> UserError:
        """The one-line error for an unknown ``name``: ``unknown {kind} {name!r}, known: a, b``
        (``known``: the names to list, default :meth:`names`; ``kind``: a more telling word than ``self.kind``)."""
        names = ", ".join(self.names() if known is None else known) or "(none registered)"
        return UserError(f"unknown {kind or self.kind} {name!r}, known: {names}")

    def get(self, name: str) -> T:
        """The object registered as ``name``.

        Raises:
            UserError: ``name`` is not registered; one line listing the known names (:meth:`unknown`).
        """
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise self.unknown(name) from None

    __getitem__ = get

    def find(self, name: str, default: D = None) -> T | D:  # type: ignore[assignment]
        """The object registered as ``name``, or ``default`` (no error: for callers that fall back)."""
        return self._entries.get(name, default)

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._entries)

    def items(self) -> tuple[tuple[str, T], ...]:
        """``(name, object)`` pairs, in registration order."""
        return tuple(self._entries.items())

    def copy(self) -> "Registry[T]":
        """An independent registry with the same entries (tests swap it in with ``monkeypatch``)."""
        new: Registry[T] = Registry(self.kind)
        new._entries.update(self._entries)
        return new

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._entries)})"


__all__ = ["Registry"]
