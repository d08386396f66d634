"""The one-shot prune's config: the one check of every section, and the builder of the Python API's keyword form.

The settings are declared once, by section, in the packages that read them (``edgeprune.pruning.settings``);
the flat :class:`~edgeprune.corp.CorpConfig` built here is their view the pipeline reads and the run record stores
(``edgeprune.pruning.settings.SECTIONS``: which section holds which of its fields). :func:`check_config` runs
``CorpConfig.validate`` and the checks that need several sections (:data:`SECTION_CHECKS`) once per config.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from edgeprune.allocation.settings import check_allocation_settings
from edgeprune.budget import budget_kinds, make_budget
from edgeprune.corp.config import SPARSITY_KEYS, CorpConfig
from edgeprune.embed.settings import check_embed_settings, is_auto
from edgeprune.errors import UserError
from edgeprune.settings import SettingError
from edgeprune.option_checks import refuse_ignored, refuse_sparsities_with_budget
from edgeprune.budget.correction import Correction
from edgeprune.tokens.schedule import AUTO, parse_candidates, parse_tokens_merge

def check_correction_settings(config: CorpConfig) -> None:
    """The measure-and-correct settings (``edgeprune.budget.correction.Correction.validate``).

    Raises:
        UserError: one line naming the setting.
    """
    Correction.of(config).validate()


def check_tokens_settings(config: CorpConfig) -> CorpConfig:
    """The token-merging schedule's form (``edgeprune.tokens.schedule.parse_tokens_merge``; the model's limits are
    checked by the ``tokens_merge`` stage) and its fit with a budget priced by a table: the table must have a token
    axis (``LatencyCost.check_tokens_merge``); the budget then carries the schedule, so the allocation prices the
    merged token counts (``edgeprune.budget.latency``). ``"auto"`` (:func:`check_tokens_auto`): the budget carries
    no schedule (each candidate's config carries its own).

    Returns:
        ``config``, or a copy with the candidates in their canonical form and the budget carrying the schedule
        (``config`` is never changed).

    Raises:
        UserError: one line naming the setting (or the table).
    """
    value = parse_tokens_merge(config.tokens_merge)
    candidates = parse_candidates(config.tokens_candidates)
    if candidates is not None and value != AUTO:
        raise UserError("tokens candidates go with tokens_merge='auto' (they would be ignored)")
    if candidates != config.tokens_candidates:
        config = dataclasses.replace(config, tokens_candidates=candidates)
    if value == AUTO:
        check_tokens_auto(config)
        value = None
    budget = config.budget
    if budget is None or not budget.model_class.needs_table:
        return config
    if value is not None:
        _check_merge_priced(budget, f"{{tokens_merge}} with a {{{budget.kind}}} budget: its table does not price "
                            "token counts, so the measured correction would undo the merge's saving; use {flops}, "
                            "{params} or {sparsity}")
    if budget.tokens_merge != value:
        config = dataclasses.replace(config, budget=dataclasses.replace(budget, tokens_merge=value))
    return config


def check_tokens_auto(config: CorpConfig) -> None:
    """``tokens_merge="auto"`` (``edgeprune.pruning.tokens_auto``): not with ``embed_sparsity="auto"`` (that one
    needs a FLOPs / params budget, this one a latency budget), a ``latency`` budget (a cost model that prices the
    merged token counts: its class has ``check_tokens_merge``; FLOPs and params budgets allocate the widths at the
    full token count, so a merge would only add error there) with a token axis, and ``allocation_check_images``
    >= 1 (the candidates are judged on those images).

    Raises:
        UserError: one line naming the setting.
    """
    if is_auto(config):
        raise SettingError("{tokens_merge} auto and {embed_sparsity} auto cannot be combined (embed auto needs "
                           "{flops}/{params}, tokens auto {latency}); choose one of them")
    budget = config.budget
    if budget is None:
        raise SettingError("{tokens_merge} auto needs a budget ({latency} with a table that has a token axis) to "
                           "choose r for; give a schedule (R, r0,r1,... or decreasing:R) without one")
    _check_merge_priced(budget, f"{{tokens_merge}} auto with a {{{budget.kind}}} budget: its cost model does not "
                        "price merged tokens (the widths get the whole budget, a merge only adds error); use {latency} "
                        "with a table that has a token axis, or give a schedule")
    if config.allocation_check_images < 1:
        raise SettingError("{tokens_merge} auto judges its candidates on the check images; give "
                           "{allocation_check_images} >= 1")


def _check_merge_priced(budget: Any, refusal: str) -> None:
    """The budget kind's own check of a merging budget (``check_tokens_merge``: e.g. the table's token axis).

    Raises:
        SettingError: ``refusal`` (a template naming settings as ``{field}``) when the kind's cost model does not
            price merged tokens; UserError: the kind's own errors.
    """
    check = getattr(budget.model_class, "check_tokens_merge", None)
    if check is None:
        raise SettingError(refusal)
    check(budget)


#: the section checks of the stages above CORP, in order (the CORP and budget sections: ``CorpConfig.validate``)
SECTION_CHECKS = (check_allocation_settings, check_embed_settings, check_correction_settings, check_tokens_settings)

_LEGACY = {"criterion": "mlp_criterion"}  # old keyword -> CorpConfig field

#: Target when none is given: with ``--sparsity`` the MLP and Q/K dims (CORP's setting); with a
#: budget also the V dims, so the allocator can spend it on every prunable dim (on the pretrained
#: DINOv2 of ``dinov2-s14-fmnist``: +1.5 points top-1 at FLOPs x0.5, +6.1 at x0.4; docs/accuracy.md).
DEFAULT_TARGET = "both"
#: the sparsity of every targeted module when neither a sparsity nor a budget is given
DEFAULT_SPARSITY = 0.5
DEFAULT_BUDGET_TARGET = "all"


def check_config(config: CorpConfig) -> CorpConfig:
    """Every section of ``config`` checked once (a config unchanged since its last check is not checked again).

    Returns:
        the checked config: ``config``, or a copy in canonical form (its budget a :class:`~edgeprune.budget.Budget`,
        the token schedule carried by a table's budget); ``config`` itself is never changed.

    Raises:
        UserError: one line naming the first bad setting.
    """
    if config.__dict__.get("_sections_valid_as") == repr(config):
        return config
    config = config.ensure_valid()
    for check in SECTION_CHECKS:  # a check returns the config in canonical form, or None (nothing to change)
        config = check(config) or config
    config.__dict__["_valid_as"] = config.__dict__["_sections_valid_as"] = repr(config)
    return config


def corp_config(target: str | None = None, sparsity: float | None = None, **settings: Any) -> CorpConfig:
    """A checked :class:`CorpConfig` from the Python API's keyword arguments (``target=``, ``sparsity=``,
    ``mlp_sparsity=``, ``criterion=``, ``ridge_alpha=`` ...). ``None`` values mean "not given" (the default;
    ``sparsity``: :data:`DEFAULT_SPARSITY` without a budget). A setting given where nothing reads it is refused
    (``edgeprune.option_checks``: a sparsity beside a budget, the check images without one, ...).

    ``flops=`` / ``params=`` / ``<kind>=`` for any registered budget kind (``edgeprune.budget``: a fraction of
    the dense model in (0, 1], or an absolute count; a number or a string such as ``"2.3G"``; ``latency=0.5`` or
    ``"12ms"`` with ``latency_table="t.json"``, docs/latency_budget.md) set a budget that replaces ``sparsity``:
    the allocator chooses the kept dims of the target's modules (``edgeprune.allocation``, METHODS.md §5
    "Budgeted allocation"). The budget's kind may imply settings (a latency table's fused layout) where none are
    given. ``target=None`` means ``"both"`` (MLP + Q/K) with a sparsity and ``"all"`` (MLP + Q/K + V) with a
    budget (:data:`DEFAULT_BUDGET_TARGET`).

    Raises:
        UserError: unknown setting, bad target or sparsity, invalid settings, two budgets, a bad budget value.
    """
    budget = make_budget(table=settings.pop("latency_table", None),
                         **{kind: settings.pop(kind) for kind in budget_kinds() if kind in settings})
    refuse_sparsities_with_budget(budget and budget.kind,
                                  {"sparsity": sparsity, **{k: settings.get(k) for k in SPARSITY_KEYS}})  # issue 32
    refuse_ignored(settings, budget and budget.kind)  # issue 41, in the library since issue 53
    Correction.pick(settings).refuse_unread(budget and budget.kind)
    if budget is None and sparsity is None:
        sparsity = DEFAULT_SPARSITY
    if budget is not None:
        settings["budget"] = budget
        sparsity = None  # the budget replaces the sparsity
        for key, value in budget.model_class.config_defaults(budget).items():
            settings[key] = value if settings.get(key) is None else settings[key]
    if target is None:
        target = DEFAULT_TARGET if budget is None else DEFAULT_BUDGET_TARGET
    if settings.get("tokens_merge") is not None:  # the canonical form (an int, a tuple, "decreasing:R")
        settings["tokens_merge"] = parse_tokens_merge(settings["tokens_merge"])
    kw = {_LEGACY.get(key, key): value for key, value in settings.items() if value is not None}
    return check_config(CorpConfig.from_target(target, sparsity, **kw))


def with_budget(config: CorpConfig, budget: Any) -> CorpConfig:
    """A checked copy of ``config`` with another budget (None: no budget)."""
    return check_config(dataclasses.replace(config, budget=budget))
