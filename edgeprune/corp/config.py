"""CORP settings: :class:`CorpConfig`, validated once, and the settings derived from it.

A config is checked by :meth:`CorpConfig.validate` (``from_target`` does it): the CORP settings and the budget
(``edgeprune.budget``, a dict given from Python becomes a :class:`~edgeprune.budget.Budget`). The settings of the
stages above CORP are checked by their own packages (allocation: ``edgeprune.allocation.settings``; embed:
``edgeprune.embed.settings``), all of them once per prune by ``edgeprune.prune.config.check_config``. The fields
stay one flat dataclass (the run record's ``config`` and the Python API's keywords); ``edgeprune.prune.config``
lists which stage reads which field (its sections).
"""

from __future__ import annotations

import dataclasses

from edgeprune.anatomy import ViTAnatomy
from edgeprune.budget import Budget, validate_budget
from edgeprune.budget.correction import DEFAULTS as CORRECTION
from edgeprune.calibration.mlp_stats import auto_gram_tokens
from edgeprune.corp.qk_solvers import get_qk_solver
from edgeprune.errors import UserError
from edgeprune.settings import SettingError
from edgeprune.layers.class_token_block import LAST_BLOCK_CHOICES
from edgeprune.plan import check_dims, check_sparsity, resolve_sparsities
from edgeprune.ranking import get_criterion
from edgeprune.solve import mlp_ridge, qk_logit
from edgeprune.solve.head_refit import check_refit_request
from edgeprune.vo import LAYOUTS


#: the sparsity setting each prunable module follows (the keys: ``edgeprune.plan.MODULES``)
MODULE_SPARSITY = {"mlp": "mlp_sparsity", "qk": "attn_sparsity", "v": "v_sparsity", "heads": "head_sparsity"}
#: CorpConfig field -> key of the record's ``sparsity`` entry (mlp and attn always; others when > 0)
SPARSITY_KEYS = {"mlp_sparsity": "mlp", "attn_sparsity": "attn", "v_sparsity": "v", "head_sparsity": "heads"}

@dataclasses.dataclass
class CorpConfig:
    """CORP settings.

    Attributes:
        mlp_sparsity, attn_sparsity: fraction of MLP hidden channels / Q/K head dims removed, [0, 1).
        v_sparsity: fraction of V head dims removed (per head, same count in every head), [0, 1).
        head_sparsity: fraction of whole heads removed per layer (kept = round(H (1 - s)) >= 1).
        layout: "default", or "fused": Q/K and V are pruned to the same kept dim per head (the
            Q/K or V sparsity given applies to both), so every block ends with qk_dim == v_dim
            and the attention is an ordinary multi-head attention (fused/flash kernels).
        vo_criterion: V-dim ranking, a criterion of ``edgeprune.ranking`` that ranks "vo":
            "combined" (default), "energy", "magnitude" or a registered one.
        dims: per-block kept dims overriding the sparsities: one dict per block with any of the
            keys "mlp" (hidden channels), "qk" (Q/K dims per head), "v" (V dims per head),
            "heads" (whole heads); a missing key follows the sparsity. Set by the budgeted
            allocation (``edgeprune.allocation``) or given directly.
        budget: a :class:`~edgeprune.budget.Budget` (or its dict form ``{"kind": "flops", "value": v}``; v a
            fraction of the dense model in (0, 1], or an absolute count > 1): the allocator chooses ``dims`` after the
            calibration pass so that the pruned model meets the budget (METHODS.md §5,
            "Budgeted allocation"); the modules it may prune are those ``target`` selects.
        sequential: sequential calibration (METHODS.md §5): statistics of block i are taken on
            the output of the already pruned blocks 0..i-1, fits target the dense outputs
            (``edgeprune.sequential``).
        allocation_check_images: with a budget, candidate allocations are compared by the
            measured output error on this many calibration images (``edgeprune.allocation.select``;
            0 = trust the allocator's proxy alone).
        allocation_sensitivity: with the check on, also measure each allocation unit's output
            error when it alone is pruned (on the same images) and add the greedy allocation on
            curves rescaled to those measurements as a candidate (``edgeprune.allocation.select``).
        allocation_sensitivity_images: the per-unit sensitivity measurement uses the first this many check
            images (default 8; None = all ``allocation_check_images``): it was the largest cost of a budgeted prune
            (one forward pass of those images from the unit's block on, per unit; issue 40 item 4: with 32 a
            ``--flops 0.5`` prune of deit_small on 256 images cost 3.2x the uniform one, with 8 1.8x; on DINOv2 the
            chosen allocation's top-1 stayed within noise, docs/allocation.md); the candidates are still compared on
            every check image.
        allocation_anchors: 1 = each unit's curve is rescaled to one measurement (at the uniform
            candidate's size); 2 = also measured where the first measured allocation puts the
            unit, the curve through both, and that greedy allocation is one more candidate.
        allocate_heads: with a budget and target ``all`` / ``v``, whole heads are one more
            allocation unit per block beside the head dims (``edgeprune.allocation.rules``);
            None = the budget kind's default (on for ``latency``, off for ``flops`` / ``params``).
        sequential_memory_gb: sequential calibration keeps its two token streams (N x n x D
            float32 each) in memory up to this many GiB, the rest in temporary disk memmaps.
        compensation: fold the closed-form compensation (False = plain removal, same ranking).
        mlp_criterion: "combined" (default), "energy", "magnitude", "active" or any criterion
            registered with ``edgeprune.ranking.register_criterion``.
        ridge_alpha: scale-free ridge strength of the MLP and proj (V/O, heads) fits
            (lam = alpha * tr(Sigma_SS)/|S|).
        qk_ridge_alpha: scale-free ridge strength of the Q/K fit (lam = alpha * mean diag of K).
        round_to: kept dims are multiples of this.
        gram_dtype: dtype of the per-batch Gram products ("float32" default, or "float64").
        gram_tokens: MLP statistics (ranking energy, mean and covariance for the ridge fit) from
            this many tokens per image instead of all n (0 = all tokens, exact). The MLP Gram is
            the largest cost of the calibration pass (~0.75 of a dense forward pass on
            deit_small); k tokens cost k/n of it. An estimator, not the exact all-token
            statistics (a random subset per image, seeded by the image's index:
            ``edgeprune.calibration.mlp_stats.token_positions``). ``None`` (default) = auto:
            ``mlp_stats.auto_gram_tokens`` (>= 64 tokens per image and >= 32 samples per hidden
            channel, else all tokens: large calibration sets only; all tokens for an unknown
            calibration size and with ``sequential``). docs/prune_cost.md measures speed and accuracy. An
            explicit K > 0 is refused with ``sequential``.
        bias_correction_images: output bias correction (``edgeprune.solve.output_bias``,
            docs/methods.md "Output bias correction"): after pruning, the mean output shift of the
            pruned model against the dense one over the first this many calibration images is
            folded into the classifier bias (models with an affine ``head`` only; others are left
            as they are). 0 = off; ``None`` (default) = auto: every calibration image with a
            budget (``budget``), off with sparsities (:func:`bias_correction_used`). The dense
            outputs come from the calibration pass (a separate pass for ``sequential``); the
            pruned model's cost one forward pass over those images.
        head_refit: with the output correction on, re-fit the whole classifier head to the dense
            outputs instead of its bias only (``edgeprune.solve.head_refit``: ridge toward the
            dense head, strength by cross-validation over the same images, the bias correction
            itself among the candidates). ``None`` (default) = auto = on whenever the output
            correction runs; False = the bias correction alone.
        last_block: "auto" (default), "cls" or "full": whether the pruned model's last block
            computes only the class token(s) its output reads (``edgeprune.layers.class_token_block``; exact, saves
            7% of a ViT-S/14's FLOPs at
            224 px). auto = with a budget, for classifiers with ``global_pool="token"``.
        embed_sparsity, embed_order, embed_refit: the residual-width slice (``edgeprune.embed``,
            docs/embed.md): fraction of the embedding dim D removed, [0, 1); "first" (slice, then
            prune widths on the sliced model) or "last"; ridge re-fit of the writers.
            ``embed_sparsity="auto"`` (with a budget, order "first"): one whole prune per candidate
            sparsity of ``embed_candidates`` (None = ``edgeprune.pruning.embed_auto.EMBED_CANDIDATES``; 0 is
            always one), the one with the lowest output error on the check images kept.
        verify_budget, correction_tolerance, correction_rounds: with a budget whose cost model is measured (a
            latency table) and its backend present here, the pruned model is measured against the dense one and,
            when it misses the budget by more than ``correction_tolerance`` (a fraction), re-allocated with a
            corrected budget from the same statistics, at most ``correction_rounds`` times
            (``edgeprune.budget.correction_loop``).
        tokens_merge: token merging after the width stages (ToMe, ``edgeprune.tokens``, docs/tokens.md): None
            (off), r per block (an int), one r per block (a tuple) or ``"decreasing:R"``; checked by
            ``edgeprune.pruning.config`` and, against the model, by the ``tokens_merge`` stage. ``"auto"`` (with a
            ``latency`` budget whose table has a token axis): one prune per candidate schedule of
            ``tokens_candidates`` (None = the model's default, ``edgeprune.pruning.tokens_auto``; 0 is always
            one), the one with the lowest output error on the check images kept.
        qk_memory_limit_gb: above this, per-image Q/K Grams are not stored; a second calibration
            pass accumulates the exact system instead (same result, one more forward pass).
        qk_solver: how the exact Q/K system is solved from per-image Grams (a solver registered
            in ``edgeprune.corp.qk_solvers``): "direct" (float64
            Cholesky of the d'^2 x d'^2 matrix), "cg" (matrix-free preconditioned conjugate
            gradients, ``edgeprune.solve.qk_logit_cg``; falls back to direct if it does not
            converge) or "auto" (the cheaper by :func:`cg_is_cheaper`; direct if alpha = 0). The
            second-pass (memory-limited) route always solves directly. Same system, same answer
            to ~1e-8 relative either way.
        rope_compensation: the Q/K compensation of a rotary head (METHODS.md §6, ``edgeprune.solve.qk_rope``):
            "pair" (one complex scalar per kept pair, from the Grams) or "general" (a full d' x d' matrix applied
            to q before the rotation; one more calibration pass, O(n d'^4) per image and head).
    """

    mlp_sparsity: float = 0.0
    attn_sparsity: float = 0.0
    compensation: bool = True
    mlp_criterion: str = "combined"
    ridge_alpha: float = mlp_ridge.DEFAULT_ALPHA
    qk_ridge_alpha: float = qk_logit.DEFAULT_ALPHA
    round_to: int = 8
    gram_dtype: str = "float32"
    gram_tokens: int | None = None
    qk_memory_limit_gb: float = 4.0
    qk_solver: str = "auto"
    rope_compensation: str = "pair"
    target: str = "custom"
    v_sparsity: float = 0.0
    head_sparsity: float = 0.0
    layout: str = "default"
    vo_criterion: str = "combined"
    dims: list | None = None
    budget: Budget | None = None
    sequential: bool = False
    sequential_memory_gb: float = 4.0
    allocation_check_images: int = 32
    allocation_sensitivity_images: int | None = 8
    allocation_sensitivity: bool = True
    allocation_anchors: int = 1
    allocate_heads: bool | None = None
    bias_correction_images: int | None = None
    head_refit: bool | None = None
    last_block: str = "auto"
    embed_sparsity: float | str = 0.0  # issue 33: residual-width slice (edgeprune.embed); "auto"
    embed_order: str = "first"
    embed_refit: bool = False
    embed_candidates: tuple | None = None  # with embed_sparsity="auto" (edgeprune.pruning.embed_auto)
    verify_budget: bool = CORRECTION["verify_budget"]  # issue 40: measure a latency budget after the prune, correct it
    correction_tolerance: float = CORRECTION["correction_tolerance"]
    correction_rounds: int = CORRECTION["correction_rounds"]
    tokens_merge: int | tuple | str | None = None  # issue 44: ToMe token merging (edgeprune.tokens.schedule)
    tokens_candidates: tuple | None = None  # with tokens_merge="auto" (edgeprune.pruning.tokens_auto)

    @classmethod
    def from_target(cls, target: str = "both", sparsity: float | None = 0.5, *,
                    mlp_sparsity: float | None = None, attn_sparsity: float | None = None,
                    v_sparsity: float | None = None, head_sparsity: float | None = None,
                    **settings) -> "CorpConfig":
        """The config the CLI and the Python API build: one sparsity for every module of
        ``target``, with optional per-module overrides, then any other field by name.

        Args:
            target: which modules to prune (``edgeprune.plan.TARGETS``).
            sparsity: fraction of each targeted module's dims removed, [0, 1).
            mlp_sparsity, attn_sparsity, v_sparsity, head_sparsity: per-module overrides (they also
                select that module).
            **settings: any other :class:`CorpConfig` field (compensation, mlp_criterion, ...).

        Raises:
            UserError: unknown target or field, sparsity out of range, invalid settings.
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - fields)
        if unknown:
            raise UserError(f"unknown CORP setting(s) {', '.join(unknown)} (known: {', '.join(sorted(fields))})")
        sp = resolve_sparsities(target, sparsity, mlp_sparsity, attn_sparsity, v_sparsity, head_sparsity)
        cfg = cls(mlp_sparsity=sp["mlp"], attn_sparsity=sp["attn"], v_sparsity=sp["v"],
                  head_sparsity=sp["heads"], target=target, **settings)
        return cfg.validate()

    def sparsity_of(self, module: str) -> float:
        """The sparsity setting module ``module`` (``edgeprune.plan.MODULES``: mlp, qk, v, heads) follows.

        Raises:
            KeyError: an unknown module.
        """
        return float(getattr(self, MODULE_SPARSITY[module]))

    def attention_sparsities(self) -> tuple[float, float]:
        """(Q/K sparsity, V sparsity) after the layout rule: ``fused`` applies the one given to both.

        Raises:
            UserError: fused layout with two different non-zero Q/K and V sparsities.
        """
        s_qk, s_v = float(self.attn_sparsity), float(self.v_sparsity)
        if self.layout == "fused":
            if s_qk > 0 and s_v > 0 and s_qk != s_v:
                raise SettingError(f"{{layout}} fused prunes Q/K and V to the same kept dim, but the Q/K sparsity "
                                   f"is {s_qk:g} and the V sparsity {s_v:g} (give one of them, or equal values)")
            s_qk = s_v = max(s_qk, s_v)
        return s_qk, s_v

    def validate(self) -> "CorpConfig":
        """Check every setting; returns the checked config: ``self``, or a copy whose budget is a
        :class:`~edgeprune.budget.Budget` where a dict was given (``self`` is never changed), marked valid until a
        field changes.

        Raises:
            UserError: an out-of-range setting, or an unknown layout, criterion, Q/K solver or
                last-block choice (the message lists the known ones).
        """
        for s in (self.mlp_sparsity, self.attn_sparsity, self.v_sparsity, self.head_sparsity):
            check_sparsity(s)
        if self.layout not in LAYOUTS:
            raise UserError(f"unknown layout {self.layout!r} (choose from {', '.join(LAYOUTS)})")
        self.attention_sparsities()
        get_criterion(self.vo_criterion, "vo")
        get_criterion(self.mlp_criterion, "mlp")
        if self.ridge_alpha < 0 or self.qk_ridge_alpha < 0:
            raise UserError("ridge alpha must be >= 0")
        if self.round_to < 1:
            raise SettingError(f"{{round_to}} must be >= 1, got {self.round_to}")
        if self.gram_dtype not in ("float64", "float32"):
            raise UserError("gram dtype must be float64 or float32")
        self._check_counts()
        if get_qk_solver(self.qk_solver).needs_ridge and self.qk_ridge_alpha == 0:
            raise SettingError(f"the {self.qk_solver} Q/K solver needs a ridge alpha > 0 (use {{qk_solver}} direct)")
        check_dims(self.dims)
        if self.rope_compensation not in ("pair", "general"):
            raise SettingError(f"{{rope_compensation}} must be pair or general, got {self.rope_compensation!r}")
        if self.rope_compensation == "general" and self.sequential:
            raise SettingError("{rope_compensation} general is not built for {sequential} calibration (its "
                               "two-stream system); use pair there")
        if self.last_block not in LAST_BLOCK_CHOICES:
            raise UserError(f"unknown last block {self.last_block!r} (choose from {', '.join(LAST_BLOCK_CHOICES)})")
        if not self.sequential_memory_gb >= 0:
            raise UserError(f"the sequential stream memory limit must be >= 0 GiB, got {self.sequential_memory_gb!r}")
        out = self
        if self.budget is not None:  # a Budget, or its dict form from Python (edgeprune.budget)
            budget = validate_budget(self.budget)
            out = self if budget is self.budget else dataclasses.replace(self, budget=budget)
        out.__dict__["_valid_as"] = repr(out)
        return out

    def _check_counts(self) -> None:
        """The integer and boolean settings (gram tokens, allocation check, bias correction, refit)."""
        if self.gram_tokens is not None and (isinstance(self.gram_tokens, bool) or not isinstance(self.gram_tokens, int)
                                             or self.gram_tokens < 0):
            raise UserError(f"gram tokens must be an int >= 0 (0 = every token), got {self.gram_tokens!r}")
        if self.gram_tokens and self.sequential:
            raise SettingError("{gram_tokens} does not apply to {sequential} calibration (it uses every token)")
        if self.allocation_anchors not in (1, 2) or isinstance(self.allocation_anchors, bool):
            raise UserError(f"allocation anchors must be 1 or 2, got {self.allocation_anchors!r}")
        if isinstance(self.allocation_check_images, bool) or not isinstance(self.allocation_check_images, int) \
                or self.allocation_check_images < 0:
            raise UserError(f"allocation check images must be an int >= 0, got {self.allocation_check_images!r}")
        n = self.allocation_sensitivity_images
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise UserError(f"allocation sensitivity images must be an int >= 1 (None = every check image), got {n!r}")
        if self.allocate_heads is not None and not isinstance(self.allocate_heads, bool):
            raise UserError(f"allocate heads must be True, False or None (auto), got {self.allocate_heads!r}")
        k = self.bias_correction_images
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise UserError(f"bias correction images must be an int >= 0 (0 = off), got {k!r}")
        if self.head_refit is not None and not isinstance(self.head_refit, bool):
            raise UserError(f"head refit must be True, False or None (auto), got {self.head_refit!r}")
        check_refit_request(self.head_refit, bias_correction_used(self))  # issue 32

    def ensure_valid(self) -> "CorpConfig":
        """``self``, validated unless it passed :meth:`validate` unchanged (the one check per call).

        Raises:
            UserError: as :meth:`validate`.
        """
        if self.__dict__.get("_valid_as") != repr(self):
            return self.validate()
        return self

    def with_dims(self, dims: list) -> "CorpConfig":
        """A copy with per-block kept ``dims`` (the allocator's), checked by ``check_dims`` only:
        the rest of a valid config is unchanged.

        Raises:
            UserError: malformed dims.
        """
        valid = self.__dict__.get("_valid_as") == repr(self)
        new = dataclasses.replace(self, dims=dims)
        check_dims(dims)
        if valid:
            new.__dict__["_valid_as"] = repr(new)
        return new


#: "every calibration image" for the output bias correction (more than any calibration set)
ALL_IMAGES = 2 ** 62


def bias_correction_used(cfg: CorpConfig) -> int:
    """Calibration images of the output bias correction: ``cfg.bias_correction_images``, or for
    ``None`` (auto) :data:`ALL_IMAGES` with a budget and 0 without. Measured on the pretrained
    DINOv2 of ``dinov2-s14-fmnist`` at FLOPs x0.5 with 256 calibration images: +0.7 to +1.2 points
    of top-1 over 3 seeds, none measurable with 1024 images (docs/accuracy.md);
    with a budget the allocation's measured selection already costs several forward passes, so
    the one extra pass of the pruned model is small there; plain CORP (sparsities) stays as the
    paper defines it unless asked."""
    if cfg.bias_correction_images is not None:
        return int(cfg.bias_correction_images)
    return ALL_IMAGES if cfg.budget is not None else 0


def gram_tokens_used(cfg: CorpConfig, anatomy: ViTAnatomy, num_images: int | None) -> int:
    """Tokens per image of the MLP statistics (0 = all): ``cfg.gram_tokens``, or for ``None``
    :func:`~edgeprune.calibration.mlp_stats.auto_gram_tokens` (all tokens with ``sequential``)."""
    if cfg.gram_tokens is not None:
        return cfg.gram_tokens
    if cfg.sequential:
        return 0
    tokens = anatomy.num_patches + anatomy.num_prefix_tokens
    return auto_gram_tokens(num_images, max(b.mlp_hidden for b in anatomy.blocks), tokens)
