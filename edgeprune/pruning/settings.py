"""A prune's settings, declared once (issue 53): the sections of the packages that read them, composed.

=============  =====================================  =====================================================
section        package                                settings
=============  =====================================  =====================================================
budget         ``edgeprune.budget.settings``          flops, params, latency, latency_table
corp           ``edgeprune.corp.settings``            target, the sparsities, layout, criteria, ridge, solver
statistics     ``edgeprune.calibration.settings``     gram_tokens, sequential, Gram dtype, memory limits
allocation     ``edgeprune.allocation.settings``      the check images, the per-unit sensitivities, heads
correction     ``edgeprune.budget.correction``        verify_budget, correction_tolerance, correction_rounds
embed          ``edgeprune.embed.settings``           embed_sparsity, embed_order, embed_refit, candidates
tokens         ``edgeprune.tokens.settings``          tokens_merge, tokens_candidates
head           ``edgeprune.pruning.head_settings``    bias correction, head refit, last block
=============  =====================================  =====================================================

The command line's options, ``--help`` groups and recipe tables are generated from these declarations
(``edgeprune.cli.generate``); the Python keywords are the field names (:meth:`PruneSettings.from_keywords`); the
run record's ``config`` is the flat :class:`~edgeprune.corp.CorpConfig` view (:meth:`PruneSettings.config`), whose
fields are these settings less the inputs it is built from (:data:`INPUTS`: the sparsity and the budget's values;
``tests/test_settings.py`` keeps the two equal).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from edgeprune.allocation.settings import AllocationSection
from edgeprune.budget.correction import Correction
from edgeprune.budget.settings import BudgetSection
from edgeprune.calibration.settings import StatisticsSection
from edgeprune.corp.config import CorpConfig
from edgeprune.corp.settings import CorpSection
from edgeprune.embed.settings import EmbedSection
from edgeprune.pruning.config import corp_config
from edgeprune.pruning.head_settings import HeadSection
from edgeprune.registry import Registry
from edgeprune.settings import Declared, Section, SettingError, declared_of
from edgeprune.tokens.settings import TokensSection

#: the sections of a prune, in help / recipe order (``register`` a section to add one; tests only)
PRUNE_SECTIONS: Registry[type[Section]] = Registry("prune settings section")
for _s in (BudgetSection, CorpSection, StatisticsSection, AllocationSection, Correction, EmbedSection, TokensSection,
           HeadSection):
    PRUNE_SECTIONS.register(_s.name, _s)

#: declared settings that are not :class:`CorpConfig` fields: the inputs the config is built from
INPUTS = ("sparsity", "flops", "params", "latency", "latency_table")
#: CorpConfig fields that no section declares: set while the config is built (the budget from the budget section,
#: target's resolved value)
BUILT = ("budget",)
#: old Python keywords still accepted (keyword -> field)
LEGACY_KEYWORDS = {"criterion": "mlp_criterion"}


def prune_sections() -> tuple[type[Section], ...]:
    """The registered prune sections, in order."""
    return tuple(cls for _name, cls in PRUNE_SECTIONS.items())


def prune_declared() -> dict[str, Declared]:
    """``{field name: Declared}`` of every prune setting (``edgeprune.settings.declared_of``)."""
    return declared_of(prune_sections())


def config_sections() -> dict[str, tuple[str, ...]]:
    """section -> the :class:`CorpConfig` fields it holds (the declarations less :data:`INPUTS`; the budget
    section also holds the :class:`~edgeprune.budget.Budget` built from its values)."""
    fields = {f.name for f in dataclasses.fields(CorpConfig)}
    out = {s.name: tuple(n for n in s.field_names() if n in fields) for s in prune_sections()}
    out[BudgetSection.name] = out[BudgetSection.name] + BUILT
    return out


#: section -> the CorpConfig fields it holds (:func:`config_sections` of the built-in sections)
SECTIONS: dict[str, tuple[str, ...]] = config_sections()


@dataclasses.dataclass(frozen=True)
class PruneSettings:
    """Every setting of a prune, by section (``sections``: section name -> :class:`~edgeprune.settings.Section`).

    Build one with :meth:`from_keywords` (``PruneSettings.from_keywords(flops=0.5, tokens_merge=4)``); read a
    section as an attribute (``settings.corp.round_to``); :meth:`config` is the checked flat view the pipeline
    reads.
    """

    sections: Mapping[str, Section]

    @classmethod
    def from_keywords(cls, **keywords: Any) -> "PruneSettings":
        """Settings from their Python keywords (field names; ``criterion`` = ``mlp_criterion``); every other
        setting at its declared default.

        Raises:
            SettingError: an unknown keyword (the message lists the sections).
        """
        declared = prune_declared()
        by_section: dict[str, dict[str, Any]] = {s.name: {} for s in prune_sections()}
        for key, value in keywords.items():
            name = LEGACY_KEYWORDS.get(key, key)
            if name not in declared:
                raise SettingError(f"unknown prune setting {key!r} (the settings: {', '.join(declared)})")
            by_section[declared[name].section][name] = value
        return cls({s.name: s.from_mapping(by_section[s.name]) for s in prune_sections()})

    def __getattr__(self, name: str) -> Section:
        sections = self.__dict__.get("sections") or {}
        if name in sections:
            return sections[name]
        raise AttributeError(name)

    def keywords(self) -> dict[str, Any]:
        """``{field name: value}`` of every setting (flat)."""
        return {k: v for s in self.sections.values() for k, v in s.items()}

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """``{section: {field: value}}``, JSON-safe (the settings as a record holds them)."""
        return {name: s.to_dict() for name, s in self.sections.items()}

    def config(self) -> CorpConfig:
        """The checked flat :class:`CorpConfig` (``edgeprune.pruning.config.corp_config``: every section's check
        once, the budget made from the budget section).

        Raises:
            UserError: one line naming the first bad setting.
        """
        sections = {name: s.validate() for name, s in self.sections.items()}
        flat = {k: v for s in sections.values() for k, v in s.items()}
        corp_fields = {f.name for f in dataclasses.fields(CorpConfig)}
        unknown = sorted(k for k in flat if k not in corp_fields and k not in INPUTS)
        if unknown:  # a section registered without its CorpConfig field (tests add toy sections)
            flat = {k: v for k, v in flat.items() if k not in unknown}
        target, sparsity = flat.pop("target"), flat.pop("sparsity")
        return corp_config(target, sparsity, **flat)


__all__ = ["BUILT", "INPUTS", "SECTIONS", "config_sections", "LEGACY_KEYWORDS", "PRUNE_SECTIONS", "PruneSettings",
           "prune_declared", "prune_sections"]
