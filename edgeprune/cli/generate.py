"""Click options generated from declared settings (issue 53: ``edgeprune.settings``): one option per setting with
``cli=True``, spelled ``--<flag or name-with-dashes>``, its parameter named as the field (no rename maps), its
type, default, metavar, choices and help from the declaration.

A command's recipe tables and ``--help`` groups follow the sections (:func:`section_table`), its essentials the
``essential`` marks (:func:`essential_keys`), and a :class:`~edgeprune.settings.SettingError` raised by the library
names the setting by its option (:func:`spelling`).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Callable, Mapping, Sequence

import click

from edgeprune.cli.options import FiniteFloat, IntList
from edgeprune.settings import Declared, Section, declared_of


def option_for(d: Declared, words: Mapping[str, str] | None = None, required: bool = False) -> click.Option:
    """The click option of one declared setting; ``words`` fill ``{placeholders}`` of its help (a command's verbs);
    ``required``: the command refuses to run without it (quantize's ``--precision``). A text setting whose default is
    a tuple is a repeatable option (``--exclude P --exclude Q``).

    Raises:
        TypeError: a declaration the generator cannot express (a programming error).
    """
    m = d.meta
    text = m.help.format(**words) if words and "{" in m.help else m.help
    kw: dict[str, Any] = {"help": text}
    if required:
        kw["required"] = True
    if m.shown_default:
        kw["help"] = f"{text} [{m.shown_default}]"
    elif d.default is not None and m.switch is None:
        kw["show_default"] = True
    if m.metavar:
        kw["metavar"] = m.metavar
    long = f"--{d.spelling}"
    if m.switch == "flag":
        return click.Option([long, d.name], is_flag=True, default=bool(d.default), **kw)
    if m.switch == "negated":
        return click.Option([long, d.name], is_flag=True, flag_value=not d.default, default=d.default, **kw)
    if m.switch == "pair":  # a bool default shows which side is on ([keep-best]); None = not given
        return click.Option([f"{long}/--{m.negation or 'no-' + d.spelling}", d.name], default=d.default,
                            show_default=isinstance(d.default, bool) and not m.shown_default, **kw)
    kind = "ints" if _is_int_tuple(d.annotation) else d.kind
    if kind == "ints":  # a comma list (--batch-sizes 1,8) -> a tuple
        kw["type"] = IntList(min=None if m.minimum is None else int(m.minimum))
    elif kind == "choice":
        kw["type"] = click.Choice(m.choice_list() or [])
    elif kind == "float":
        kw["type"] = FiniteFloat(min=m.minimum)
    elif kind == "int":
        kw["type"] = click.IntRange(min=int(m.minimum)) if m.minimum is not None else int
    elif kind == "text":
        kw["type"] = click.STRING  # not inferred from the default (an embed sparsity's 0.0 is also "auto")
        if isinstance(d.default, tuple):  # repeatable: each use adds one value
            kw.update(multiple=True, show_default=bool(d.default))
    elif kind == "bool":
        raise TypeError(f"setting {d.name!r} is a bool without a switch (flag, negated or pair)")
    if not required:  # click takes an explicit None default for a given value
        kw["default"] = d.default
    return click.Option([long, d.name], **kw)


def _is_int_tuple(annotation: Any) -> bool:
    """``tuple[int, ...]`` (or ``| None``): a setting typed as a comma list of integers."""
    args = [a for a in (typing.get_args(annotation) or (annotation,)) if a is not type(None)]
    if typing.get_origin(annotation) is tuple:
        args = [annotation]
    return len(args) == 1 and typing.get_origin(args[0]) is tuple and typing.get_args(args[0])[:1] == (int,)


def options(sections: Sequence[type[Section]], words: Mapping[str, str] | None = None,
            required: Sequence[str] = ()) -> Callable:
    """A decorator adding the options of every command-line setting of ``sections``, in declaration order;
    ``required``: the fields the command cannot run without (quantize's ``precision``)."""
    return _adding([d for d in declared_of(sections).values() if d.meta.cli], words, required)


def _adding(declared: Sequence[Declared], words: Mapping[str, str] | None, required: Sequence[str] = ()) -> Callable:
    """A decorator adding the options of ``declared`` (:func:`option_for`), in that order, to a click command
    function (click's ``__click_params__`` list, as ``@click.option`` does)."""

    def deco(f: Callable) -> Callable:
        params = getattr(f, "__click_params__", [])
        for d in reversed(declared):
            params.append(option_for(d, words, required=d.name in required))
        f.__click_params__ = params  # type: ignore[attr-defined]
        return f

    return deco


def section_table(sections: Sequence[type[Section]]) -> dict[str, list[str]]:
    """``{section name: option keys}`` of the command-line settings (the recipe tables and help groups)."""
    out: dict[str, list[str]] = {}
    for s in sections:
        keys = [d.spelling for d in s.declared() if d.meta.cli]
        if keys:
            out[s.name] = keys
    return out


def section_titles(sections: Sequence[type[Section]]) -> dict[str, str]:
    """``{section name: title}`` (the ``--help-all`` panel names)."""
    return {s.name: s.title or s.name.capitalize() for s in sections}


def essential_keys(sections: Sequence[type[Section]]) -> list[str]:
    """The option keys of the settings marked ``essential``, in declaration order."""
    return [d.spelling for s in sections for d in s.declared() if d.meta.cli and d.meta.essential]


def spelling(sections: Sequence[type[Section]]) -> Callable[[str], str | None]:
    """Field name -> ``--option`` of ``sections`` (None for a setting with no option)."""
    declared = declared_of(sections)

    def spell(name: str) -> str | None:
        d = declared.get(name)
        return f"--{d.spelling}" if d is not None and d.meta.cli else None

    return spell


def setting_names(sections: Sequence[type[Section]]) -> tuple[str, ...]:
    """The parameter names of the generated options (the fields with ``cli=True``)."""
    return tuple(d.name for d in declared_of(sections).values() if d.meta.cli)


def handed_on(sections: Sequence[type[Section]], names: Sequence[str], words: Mapping[str, str] | None = None,
              shown_default: Mapping[str, str | None] | None = None) -> Callable:
    """A decorator adding the options of the settings ``names`` of ``sections`` only, in ``names``' order: a command
    that hands some of another job's settings on (deploy: the prune's budget and token merging). ``shown_default``
    replaces the ``[...]`` of some (``{name: text or None}``: where this command resolves them otherwise).

    Raises:
        KeyError: a name ``sections`` do not declare (a programming error).
    """
    declared = declared_of(sections)
    chosen = []
    for name in names:
        d = declared[name]
        if shown_default and name in shown_default:
            d = dataclasses.replace(d, meta=dataclasses.replace(d.meta, shown_default=shown_default[name]))
        chosen.append(d)
    return _adding(chosen, words)


__all__ = ["essential_keys", "handed_on", "option_for", "options", "section_table", "section_titles", "setting_names",
           "spelling"]
