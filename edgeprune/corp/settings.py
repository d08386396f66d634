"""The CORP section of a prune's settings (issue 53): which dims are pruned, how they are ranked and how the
closed-form compensation is solved (corp-v1 Alg. 1; METHODS.md §2-4). The flat
:class:`~edgeprune.corp.CorpConfig` is its view (with the other sections of ``edgeprune.pruning.settings``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from edgeprune.corp.qk_solvers import list_qk_solvers
from edgeprune.plan import TARGETS
from edgeprune.ranking import list_criteria
from edgeprune.settings import Section, setting
from edgeprune.solve import mlp_ridge, qk_logit
from edgeprune.vo import LAYOUTS

_TARGET_WORDS = {"mlp": "MLP hidden channels", "attn": "Q/K head dims", "v": "V/O head dims",
                 "heads": "whole attention heads", "both": "mlp + attn", "all": "every kind"}


def target_help() -> str:
    """The help line of ``target``: every target of ``edgeprune.plan.TARGETS`` with what it prunes."""
    parts = [f"{t} ({_TARGET_WORDS[t]})" if t in _TARGET_WORDS else t for t in TARGETS]
    return "Which dims to prune: " + ", ".join(parts) + "."


def _mlp_criteria() -> list[str]:
    return list_criteria("mlp")


@dataclasses.dataclass(frozen=True)
class CorpSection(Section):
    """What CORP prunes and how (``edgeprune.corp.config.CorpConfig`` documents each field's effect).

    ``sparsity`` None = 0.5 without a budget (given with one: refused); ``target`` None = "both" with sparsities,
    "all" with a budget (``edgeprune.pruning.config``); ``layout`` None = "default" unless the budget implies one (a
    latency table's fused layout); a per-module sparsity None = ``sparsity`` where ``target`` selects the module,
    else 0 (``edgeprune.plan.resolve_sparsities``).
    """

    name: ClassVar[str] = "corp"
    title: ClassVar[str] = "CORP"

    target: str | None = setting(None, target_help(), choices=TARGETS, essential=True,
                                 shown_default="both; all with a budget")
    sparsity: float | None = setting(None, "Fraction of each targeted module's dims removed, in [0, 1).",
                                     essential=True, unit="fraction", shown_default="0.5")
    mlp_sparsity: float | None = setting(None, "Override the MLP sparsity (selects the MLP).", unit="fraction")
    attn_sparsity: float | None = setting(None, "Override the Q/K sparsity (selects Q/K).", unit="fraction")
    v_sparsity: float | None = setting(None, "Override the V/O sparsity (selects V/O).", unit="fraction")
    head_sparsity: float | None = setting(None, "Fraction of whole attention heads removed.", unit="fraction")
    layout: str | None = setting(None, "Attention weight layout of the pruned model.", choices=LAYOUTS,
                                 shown_default="default")
    mlp_criterion: str = setting("combined", "MLP channel ranking (a registered criterion, edgeprune.ranking).",
                                 flag="criterion", choices=_mlp_criteria)
    compensation: bool = setting(True, "Uncompensated baseline (same ranking, plain removal).",
                                 flag="no-compensation", switch="negated")
    ridge_alpha: float = setting(mlp_ridge.DEFAULT_ALPHA, "Scale-free MLP ridge strength.",
                                 shown_default=f"{mlp_ridge.DEFAULT_ALPHA:g}")
    qk_ridge_alpha: float = setting(qk_logit.DEFAULT_ALPHA, "Scale-free Q/K ridge strength.",
                                    shown_default=f"{qk_logit.DEFAULT_ALPHA:g}")
    qk_solver: str = setting("auto", "Exact Q/K system: Cholesky, matrix-free CG, or the cheaper of the two.",
                             choices=list_qk_solvers)
    round_to: int = setting(8, "Kept dims are multiples of this.")
    rope_compensation: str = setting(
        "pair", "Q/K compensation of a rotary (RoPE) head: one complex scalar per kept pair, or a full matrix "
        "before the rotation (a second calibration pass, O(n d'^4) per image and head; docs/rope.md).",
        choices=("pair", "general"))
    vo_criterion: str = setting("combined", "V-dim ranking (a criterion of edgeprune.ranking that ranks vo).",
                                cli=False)
    dims: tuple | None = setting(None, "Per-block kept dims overriding the sparsities (set by the allocation).",
                                 cli=False)


__all__ = ["CorpSection", "target_help"]
