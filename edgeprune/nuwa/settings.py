"""A NuWa derivation's settings, declared once (issue 53): the section ``[nuwa]`` and the sections of a derive.

=============  =====================================  =====================================================
section        package                                settings
=============  =====================================  =====================================================
budget         ``edgeprune.budget.settings``          flops, params, latency, latency_table
correction     ``edgeprune.budget.correction``        verify_budget, correction_tolerance, correction_rounds
nuwa           ``edgeprune.nuwa.settings``            the head, SKP, the SVD truncation, the MLP re-fit, cache
=============  =====================================  =====================================================

``edgeprune derive``'s setting options, ``--help-all`` groups and recipe tables are generated from these
declarations (``edgeprune.cli.generate``); their Python keywords, the field names, are
:func:`edgeprune.jobs.derive_run.derive_run`'s (``--skp-steps`` = ``skp_steps``). The job's own inputs (the model,
the classes, the data and their counts, the seed, the devices, the output) are not settings. The run record's
``config`` is the :class:`~edgeprune.nuwa.config.DeriveConfig` view (:meth:`NuwaSection.config`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from edgeprune.budget.correction import Correction
from edgeprune.budget.settings import BudgetSection
from edgeprune.nuwa.config import DeriveConfig
from edgeprune.nuwa.ofp_mha import KEY_BIAS_MODES
from edgeprune.nuwa.ofp_mlp import DEFAULT_RIDGE_ALPHA
from edgeprune.nuwa.skp import SKPConfig
from edgeprune.settings import Declared, Section, declared_of, setting


@dataclasses.dataclass(frozen=True)
class NuwaSection(Section):
    """How NuWa derives (nuwa §3): the head, SKP's masks (§3.2), the attention truncation (§3.3) and the MLP
    re-fit; :meth:`config` is the :class:`DeriveConfig` the derivation reads."""

    name: ClassVar[str] = "nuwa"
    title: ClassVar[str] = "Method"  # the --help-all group of derive's method options, as before

    slice_head: bool = setting(False, "Slice the head to the target classes (default: suppress the others with a "
                               "-100 bias).", switch="flag")
    skp_steps: int = setting(400, "SKP optimiser steps (0 = no SKP; the paper uses 10000).")
    skp_batch_size: int = setting(1, "Images per SKP step.")
    skp_eval_every: int = setting(50, "Evaluate SKP masks every N steps.")
    lr_beta: float = setting(0.1, "SKP learning rate of the mask scales.")
    lr_mask: float = setting(1e-3, "SKP learning rate of the mask logits.")
    weight_decay: float = setting(0.05, "SKP weight decay.")
    rho: float | None = setting(None, "Fix the retained singular-value energy ratio [search].")
    key_bias: str = setting("drop", "Leave the softmax-invariant key bias out of the QK SVD, or augment with it.",
                            choices=KEY_BIAS_MODES)
    ridge_alpha: float = setting(DEFAULT_RIDGE_ALPHA, "Ridge of the fc2 least-squares re-fit.")
    no_cache: bool = setting(False, "Do not read or write the on-disk SVD cache.", switch="flag")

    def skp(self, seed: int = 0) -> SKPConfig:
        """The SKP settings (``seed``: the job's, which also draws the data split)."""
        return SKPConfig(steps=self.skp_steps, batch_size=self.skp_batch_size, lr_beta=self.lr_beta,
                         lr_mask=self.lr_mask, weight_decay=self.weight_decay, eval_every=self.skp_eval_every,
                         seed=seed)

    def config(self, correction: Correction | None = None, **inputs: Any) -> DeriveConfig:
        """The :class:`DeriveConfig` of these settings, not yet validated: ``correction`` (None = its defaults)
        and the job's inputs that are config fields (``val_size``, ``calib_size``, ``seed``, ``device``; missing
        ones at DeriveConfig's defaults)."""
        corr = (correction or Correction()).resolved()
        return DeriveConfig(skp=self.skp(inputs.get("seed", 0)), head="slice" if self.slice_head else "suppress",
                            rho=self.rho, key_bias=self.key_bias, ridge_alpha=self.ridge_alpha,
                            cache=not self.no_cache, **inputs, **corr.to_dict())

    def validate(self) -> "NuwaSection":
        """The section, checked as the derivation checks it (:meth:`DeriveConfig.validate`).

        Raises:
            UserError: one line naming the first bad setting.
        """
        self.config().validate()
        return self


#: the sections of a derive, in help / recipe order
DERIVE_SECTIONS: tuple[type[Section], ...] = (BudgetSection, Correction, NuwaSection)


def derive_declared() -> dict[str, Declared]:
    """``{field name: Declared}`` of every derive setting (``edgeprune.settings.declared_of``)."""
    return declared_of(DERIVE_SECTIONS)


__all__ = ["DERIVE_SECTIONS", "NuwaSection", "derive_declared"]
