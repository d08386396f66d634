"""Settings declared once (issue 53): a setting is a dataclass field of a :class:`Section` with its metadata.

A section is a frozen dataclass owned by the package that reads it (``edgeprune.corp.settings``,
``edgeprune.allocation.settings``, ``edgeprune.budget.correction`` ...). Each field is declared with
:func:`setting`: its default, help text, unit, whether a newcomer's ``--help`` shows it (``essential``), and
its command-line spelling where it differs from the field name (``flag="check-images"``). Everything else is a
view of that declaration:

* the click options of a command (``edgeprune.cli.generate``: type, default, help, metavar, choices, flag
  pairs), its ``--help`` groups and essentials, and its recipe sections (one TOML table per section, keys in the
  option spelling);
* the Python keywords (:meth:`Section.from_mapping`, the field names);
* the run record (:meth:`Section.to_dict`, JSON-safe).

:meth:`Section.validate` never mutates: it returns the section itself or a normalised copy, and raises
:class:`SettingError`, which names the setting in the caller's spelling (:meth:`SettingError.spelled`: the
CLI's ``--check-images``, a recipe's ``check-images``, Python's ``allocation_check_images``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from typing import Any, Callable, ClassVar, Iterator, Mapping, Sequence, TypeVar

from edgeprune.atomic import atomic_write_text
from edgeprune.errors import UserError

#: the metadata key of a declared setting on its dataclass field
META = "edgeprune.setting"

#: how a boolean setting is typed on the command line: "flag" (``--x`` sets True), "negated" (``--no-x`` sets
#: False; the flag spelling names the negation), "pair" (``--x/--no-x``)
SWITCHES = ("flag", "negated", "pair")
#: value kinds a setting may have on the command line (``kind=``; inferred from the field's annotation)
KINDS = ("float", "int", "bool", "text", "choice")

S = TypeVar("S", bound="Section")


@dataclasses.dataclass(frozen=True)
class Meta:
    """A setting's declaration beside its default (see :func:`setting`)."""

    help: str
    flag: str | None = None
    metavar: str | None = None
    unit: str | None = None
    essential: bool = False
    choices: Callable[[], Sequence[str]] | Sequence[str] | None = None
    kind: str | None = None
    switch: str | None = None
    cli: bool = True
    shown_default: str | None = None
    minimum: float | None = None
    negation: str | None = None

    def choice_list(self) -> list[str] | None:
        """The allowed values (called when the registry behind them is asked: plugins registered late count)."""
        if self.choices is None:
            return None
        return list(self.choices() if callable(self.choices) else self.choices)


def setting(default: Any, help: str, *, flag: str | None = None, metavar: str | None = None, unit: str | None = None,
            essential: bool = False, choices: Callable[[], Sequence[str]] | Sequence[str] | None = None,
            kind: str | None = None, switch: str | None = None, cli: bool = True, shown_default: str | None = None,
            minimum: float | None = None, negation: str | None = None) -> Any:
    """Declare one setting: a dataclass field of a :class:`Section`.

    Args:
        default: the value when nobody sets it (``None`` = "auto": the section resolves it; say how in
            ``shown_default``, the ``[...]`` of the help line).
        help: one sentence for ``--help`` (the unit in ``unit``, the default is added).
        flag: the command-line spelling without ``--`` where it is not the field name with dashes
            (``"check-images"`` for ``allocation_check_images``); for ``switch="negated"`` the negation
            (``"no-compensation"``). Recipe keys use the same spelling.
        metavar, unit, essential: the help's value name, the unit ("fraction", "GiB", "images"), and whether a
            newcomer's ``--help`` shows it (the rest: ``--help-all``).
        choices: allowed values, or a function returning them (a registry's names).
        kind: "float", "int", "bool", "text" or "choice" where the annotation does not say it.
        switch: for a boolean: "flag", "negated" or "pair" (:data:`SWITCHES`).
        cli: False = a Python/record setting with no option (set from Python or by another stage).
        minimum: the smallest allowed value of a number (checked while the option is parsed).
        negation: for ``switch="pair"``, the negative spelling without ``--`` where it is not ``no-<flag>``
            (``"keep-last"`` of ``keep-best``).

    Raises:
        ValueError: an unknown ``switch`` or ``kind`` (a programming error of the declaration).
    """
    if switch is not None and switch not in SWITCHES:
        raise ValueError(f"unknown switch {switch!r} (choose from {', '.join(SWITCHES)})")
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r} (choose from {', '.join(KINDS)})")
    meta = Meta(help=help, flag=flag, metavar=metavar, unit=unit, essential=essential, choices=choices, kind=kind,
                switch=switch, cli=cli, shown_default=shown_default, minimum=minimum, negation=negation)
    if isinstance(default, (list, dict, set)):
        raise ValueError("a setting's default must be immutable (a tuple, not a list)")
    return dataclasses.field(default=default, metadata={META: meta})


@dataclasses.dataclass(frozen=True)
class Declared:
    """One declared setting as the views read it: its section, field name, default, annotation and metadata."""

    section: str
    name: str
    default: Any
    annotation: Any
    meta: Meta

    @property
    def spelling(self) -> str:
        """The option / recipe-key spelling without ``--`` (``meta.flag`` or the name with dashes)."""
        return self.meta.flag or self.name.replace("_", "-")

    @property
    def kind(self) -> str:
        """The value kind on the command line (:data:`KINDS`)."""
        if self.meta.kind:
            return self.meta.kind
        if self.meta.choices is not None:
            return "choice"
        args = set(typing.get_args(self.annotation)) or {self.annotation}
        args.discard(type(None))
        if args == {bool}:
            return "bool"
        if args == {int}:
            return "int"
        if args in ({float}, {float, int}):
            return "float"
        return "text"


_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{(not:)?([a-z][a-z0-9_]*)\}")


class SettingError(UserError):
    """A bad setting, named in the caller's spelling.

    ``template`` names each setting it speaks of as ``{field}`` (``"{round_to} must be >= 1, got 0"``,
    ``"{embed_sparsity} auto judges its candidates on the check images; give {allocation_check_images} >= 1"``);
    ``str(err)`` shows the Python keywords (the field names), :meth:`spelled` another spelling (the command line's
    ``--round-to``). ``{not:field}`` names a boolean set False (``verify_budget=False``; the command line's
    ``--no-verify-latency``). Other braces in the text are left alone (only ``{lower_case_name}`` is a placeholder);
    a value put in the text (a path, a model name) goes through :meth:`literal`, whose doubled braces show as one.
    """

    @staticmethod
    def literal(value: object) -> str:
        """``str(value)`` for a template, its braces doubled: never read as a placeholder, shown as they are."""
        return str(value).replace("{", "{{").replace("}", "}}")

    def __init__(self, template: str) -> None:
        self.template = template
        #: the fields the message names, in order
        self.settings = tuple(dict.fromkeys(m.group(2) for m in _PLACEHOLDER.finditer(template) if m.group(2)))
        super().__init__(self.render(lambda name: name))

    @property
    def setting(self) -> str | None:
        """The first setting the message names (None for none)."""
        return self.settings[0] if self.settings else None

    def render(self, spell: Callable[[str], str | None]) -> str:
        """The message with each ``{field}`` spelled by ``spell`` (the field name where it gives None)."""
        def one(m: re.Match) -> str:
            if not m.group(2):  # a doubled brace of a literal value
                return m.group(0)[0]
            name = spell(m.group(2))
            if m.group(1):  # {not:field}: the negation
                return name.replace("--", "--no-", 1) if name and name.startswith("--") else f"{m.group(2)}=False"
            return name or m.group(2)

        return _PLACEHOLDER.sub(one, self.template)

    def spelled(self, spell: Callable[[str], str | None]) -> UserError:
        """The same error as a :class:`~edgeprune.errors.UserError` with the settings spelled by ``spell``."""
        return UserError(self.render(spell))


@dataclasses.dataclass(frozen=True)
class Section:
    """A frozen group of declared settings owned by one package.

    Subclasses set ``name`` (the recipe table, the record key and the ``--help-all`` group: one vocabulary) and
    ``title``; their fields are :func:`setting` declarations. :meth:`validate` returns a checked (possibly
    normalised) section and never changes ``self``.
    """

    name: ClassVar[str] = ""
    title: ClassVar[str] = ""

    @classmethod
    def declared(cls) -> tuple[Declared, ...]:
        """The section's settings in declaration order.

        Raises:
            TypeError: a field declared without :func:`setting` (a programming error).
        """
        hints = typing.get_type_hints(cls)
        out = []
        for f in dataclasses.fields(cls):
            meta = f.metadata.get(META)
            if meta is None:
                raise TypeError(f"{cls.__name__}.{f.name} is not declared with edgeprune.settings.setting()")
            out.append(Declared(cls.name, f.name, f.default, hints.get(f.name, f.type), meta))
        return tuple(out)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The section's field names (its Python keywords)."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_mapping(cls: type[S], values: Mapping[str, Any]) -> S:
        """A section from ``{field name: value}`` (missing fields take their defaults), not yet validated.

        Raises:
            SettingError: an unknown key (the message lists the known ones).
        """
        known = cls.field_names()
        for key in values:
            if key not in known:
                raise SettingError(f"unknown {cls.name} setting {key!r} (known: {', '.join(known)})")
        return cls(**dict(values))

    def validate(self: S) -> S:
        """The checked section (a normalised copy where a value has a canonical form); the base checks nothing.

        Raises:
            SettingError: naming the first bad setting.
        """
        return self

    @classmethod
    def pick(cls: type[S], values: Mapping[str, Any]) -> S:
        """A section of the fields ``values`` holds (its other keys ignored, missing fields at their defaults), not
        yet validated: the section's share of a caller's keywords."""
        return cls(**{k: values[k] for k in cls.field_names() if k in values})

    def replace(self: S, **changes: Any) -> S:
        """A copy with some fields changed (not validated)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """``{field: value}``, JSON-safe (tuples as lists; objects with ``to_dict`` as their dict)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.to_dict() if hasattr(v, "to_dict") else v
        return json.loads(json.dumps(out, default=str))

    def items(self) -> Iterator[tuple[str, Any]]:
        """``(field name, value)`` pairs in declaration order."""
        for f in dataclasses.fields(self):
            yield f.name, getattr(self, f.name)


def declared_of(sections: Sequence[type[Section]]) -> dict[str, Declared]:
    """``{field name: Declared}`` over several sections.

    Raises:
        TypeError: one field name declared by two of them, or two sections with one name (programming errors: a
            setting is declared once).
    """
    out: dict[str, Declared] = {}
    names = [s.name for s in sections]
    if len(set(names)) != len(names):
        raise TypeError(f"two sections share a name: {names}")
    for section in sections:
        for d in section.declared():
            if d.name in out:
                raise TypeError(f"setting {d.name!r} declared in [{out[d.name].section}] and [{d.section}]")
            out[d.name] = d
    return out


def write_recipe_text(path: Any, text: str) -> None:
    """Write a recipe (the TOML view of a command's settings) to ``path`` atomically (:mod:`edgeprune.atomic`: a
    reader sees the old file or the new one, never half of it)."""
    atomic_write_text(path, text)


__all__ = ["Declared", "META", "Meta", "Section", "SettingError", "SWITCHES", "declared_of", "setting",
           "write_recipe_text"]
