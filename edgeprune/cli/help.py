"""Help a newcomer can read (issue 42): the command class of the commands that make something.

:class:`RecipeCommand` (``@click.command("prune", cls=RecipeCommand)``) is rich-click's
``RichCommand`` (option panels drawn by the library, not by hand) plus:

* ``--help``: the command's essential options (:data:`ESSENTIALS`, at most 15 with the help
  options) in one panel, then one line naming the other groups and how many options each holds;
* ``--help-all``: the essentials first, then every other option in its group (the recipe sections
  of :data:`edgeprune.cli.recipe.SECTIONS`: Model, Data, Budget, Method, Output, Runtime);
* ``--config FILE.toml``: the options from a recipe file (:mod:`edgeprune.cli.recipe`); a budget
  typed on the command line replaces the file's; a conflict found later names the file's key.
"""

from __future__ import annotations

from typing import Any, Sequence

import click
from rich.text import Text
from rich_click import RichCommand
from rich_click.rich_panel import RichOptionPanel

from edgeprune.cli.generate import essential_keys, section_titles, spelling
from edgeprune.cli.recipe import (budget_from_command_line, config_option, name_recipe_keys, param_key, recipe_params,
                                  section_of, section_order)
from edgeprune.errors import UserError
from edgeprune.settings import Section, SettingError

#: the ctx.meta key set by --help-all
META_HELP_ALL = "edgeprune.help_all"

_HELP = ["config", "help-all", "help"]

#: where a command's declared settings marked ``essential`` go among its own essentials (``edgeprune.settings``)
SETTINGS_MARK = "*settings*"

#: command -> the options its --help shows (the rest: --help-all)
ESSENTIALS: dict[str, list[str]] = {
    "prune": ["model", "checkpoint", "calib", "*settings*", "eval-data", "device", "out"],
    "heal": ["calib", "calib-size", "epochs", "lr", "eval-data", "holdout", "device", "out"],
    "derive": ["model", "checkpoint", "classes", "flops", "params", "latency", "latency-table", "train-data",
               "calib", "eval-data", "device", "out"],
    "quantize": ["precision", "output", "mode", "recipe", "calib", "calib-size", "eval-data", "max-drop", "force"],
    "deploy": ["model", "checkpoint", "calib", "sparsity", "flops", "params", "latency", "latency-table",
               "eval-data", "precision", "device", "out"],
    "latency-table": ["model", "random-init", "checkpoint", "device", "batch", "out", "force"],
}


def _help_all_callback(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    ctx.meta[META_HELP_ALL] = True
    click.echo(ctx.get_help(), color=ctx.color)
    ctx.exit()


class SettingsCommand(click.Command):
    """A command whose options are generated from declared settings sections: a library
    :class:`~edgeprune.settings.SettingError` names them by their options (issue 53: the job tells a Python caller
    ``static_batch``, this command ``--static-batch``)."""

    def __init__(self, *args: Any, settings_sections: Sequence[type[Section]] = (),
                 spelled_by: Sequence[type[Section]] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: the declared settings sections whose options the command has (``edgeprune.cli.generate``)
        self.settings_sections = tuple(settings_sections)
        #: the sections whose option spelling names a library error's settings (default: ``settings_sections``;
        #: deploy: the prune's, whose options it hands on)
        self.spelled_by = tuple(spelled_by) or self.settings_sections

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except SettingError as err:  # named by its option
            raise err.spelled(self._spell(ctx)) from None

    def _spell(self, ctx: click.Context) -> Any:
        """A setting's name -> its option: the declared sections' spelling, else the command's own option of that
        parameter name (its first long flag), else None (the name as it is)."""
        declared = spelling(self.spelled_by)
        own = {p.name: next((o for o in p.opts if o.startswith("--")), None) for p in ctx.command.params
               if isinstance(p, click.Option)}
        return lambda name: declared(name) or own.get(name)


class RecipeCommand(SettingsCommand, RichCommand):
    """A command with grouped help (essentials / --help-all) and ``--config FILE.toml``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params.append(config_option())
        self.params.append(click.Option(["--help-all"], is_flag=True, is_eager=True, expose_value=False,
                                        callback=_help_all_callback, help="Show every option, by group."))

    # ---- options and recipes
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        rest = super().parse_args(ctx, args)
        budget_from_command_line(ctx)
        return rest

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)  # a SettingError comes back spelled by its option (SettingsCommand)
        except UserError as err:  # and the recipe's key where it came from --config
            raise name_recipe_keys(ctx, err) from None

    # ---- help
    def essentials(self) -> list[str]:
        """The keys --help shows (the command's essentials, then --config, --help-all, --help)."""
        keys = recipe_params(self)
        own = ESSENTIALS.get(str(self.name), [])
        if SETTINGS_MARK in own:
            i = own.index(SETTINGS_MARK)
            own = own[:i] + essential_keys(self.settings_sections) + own[i + 1:]
        return [k for k in own if k in keys] + _HELP

    def groups(self) -> dict[str, list[str]]:
        """``{group title: keys}`` of the options --help leaves out (recipe sections, in order)."""
        shown, sections = set(self.essentials()), section_of(self)
        options = {param_key(p) for p in self.params if isinstance(p, click.Option)}
        titles = section_titles(self.settings_sections)
        out: dict[str, list[str]] = {}
        for section in section_order(self):
            keys = [k for k, s in sections.items() if s == section and k not in shown and k in options]
            if keys:
                out[titles.get(section, section.capitalize())] = keys
        return out

    def _opt(self, key: str) -> str:
        return "--help" if key == "help" else f"--{key}"

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        full = bool(ctx.meta.get(META_HELP_ALL))
        groups = self.groups()
        panels = [RichOptionPanel("Essential options", options=[self._opt(k) for k in self.essentials()])]
        if full:
            panels += [RichOptionPanel(f"{title} options", options=[self._opt(k) for k in keys])
                       for title, keys in groups.items()]
        hidden_keys = {k for keys in groups.values() for k in keys} if not full else set()
        hide = [p for p in self.params if isinstance(p, click.Option) and not p.hidden
                and param_key(p) in hidden_keys]
        saved = self.panels
        self.panels = panels
        for p in hide:
            p.hidden = True
        try:
            super().format_options(ctx, formatter)
        finally:
            self.panels = saved
            for p in hide:
                p.hidden = False
        if not full and groups:
            counts = ", ".join(f"{title} ({len(keys)})" for title, keys in groups.items())
            formatter.write(Text(f" More options: {counts}. All of them, by group: edgeprune {self.name} "
                                 "--help-all\n"))  # type: ignore[arg-type]


__all__ = ["ESSENTIALS", "SETTINGS_MARK", "RecipeCommand", "META_HELP_ALL"]
