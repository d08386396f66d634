"""The built-in stages of the one-shot prune, registered in the order they run (``edgeprune.pruning.stage``):

1. ``embed_first`` -- the residual-width slice before the width pruning (``edgeprune.embed``, ``embed_order``
   "first"); a fractional budget is made absolute on the unsliced model first;
2. ``corp`` -- CORP: statistics -> allocation (with a budget) -> plan -> solve -> cut (``edgeprune.pruning.corp``);
3. ``embed_last`` -- the slice after the width pruning (``embed_order`` "last");
4. ``class_token_block`` -- the last block computes only the class token(s) its output reads (exact);
5. ``output_correction`` -- the classifier re-fit / bias correction (``edgeprune.pruning.output``).
"""

from __future__ import annotations

import time

from edgeprune.corp.config import bias_correction_used
from edgeprune.embed.step import embed_budget, embed_stage, slices_first
from edgeprune.layers.class_token_block import class_token_plan, to_class_token_block
from edgeprune.pruning.corp import check_prunable, corp_prune
from edgeprune.pruning.output import BiasCorrection
from edgeprune.pruning.stage import PruneState, Stage, register_stage


@register_stage("embed_first")
class EmbedFirst(Stage):
    """Slices the residual stream before CORP (``embed_order="first"``); checks the slice and turns a fractional
    budget into the unsliced model's absolute count (``edgeprune.embed.step.embed_budget``)."""

    calibration_device = True
    when = "first"

    def prepare(self, state: PruneState) -> None:
        if self.when == "first":  # once for both embed stages; after every check, as a check itself
            state.config = embed_budget(state.config, state.anatomy)

    def run(self, state: PruneState) -> None:
        state.anatomy, state.config, state.info["embed"] = embed_stage(
            state.anatomy, state.batches, state.config, self.when, state.info.get("embed"))


@register_stage("corp")
class Corp(Stage):
    """CORP on the (possibly sliced) model: statistics, allocation under a budget, plan, solve, cut."""

    calibration_device = True

    def check(self, state: PruneState) -> None:
        state.extra["last_block"] = class_token_plan(state.config, state.anatomy)  # --last-block cls refusals
        state.config = check_prunable(state.anatomy, state.config)  # rounding, dims and an unreachable budget

    def run(self, state: PruneState) -> None:
        embed = state.info.get("embed")
        state.info = corp_prune(state.anatomy, state.batches, state.config, num_images=state.num_images,
                                progress=state.progress, checked=True, statistics=state.extra.get("statistics"))
        state.extra["statistics"] = state.info.pop("statistics", None)  # a later round reuses them (latency_loop)
        state.info["embed"] = embed


@register_stage("embed_last")
class EmbedLast(EmbedFirst):
    """Slices the residual stream after CORP (``embed_order="last"``)."""

    when = "last"


@register_stage("class_token_block")
class ClassTokenBlock(Stage):
    """The last block computes only the query tokens the output reads (exact; ``--last-block``)."""

    def run(self, state: PruneState) -> None:
        last_block = state.extra.get("last_block")
        if last_block:
            to_class_token_block(state.anatomy.vit, next(iter(last_block.values())))


@register_stage("output_correction")
class OutputCorrection(Stage):
    """Folds the mean output shift (or a classifier re-fit) measured on the calibration images into the head.
    The dense outputs come from CORP's pass, or from a pass made here before the model changes when the model is
    pruned block by block or sliced first."""

    def prepare(self, state: PruneState) -> None:
        cfg = state.config
        state.extra["output_correction"] = BiasCorrection(
            state.model, state.batches, bias_correction_used(cfg), cfg.sequential or slices_first(cfg),
            refit=cfg.head_refit is not False)

    def run(self, state: PruneState) -> None:
        correction = state.extra["output_correction"]
        t0 = time.perf_counter()
        state.info["bias_correction"] = correction.fold(state.model, state.info.get("output_sums"),
                                                        state.info.get("output_rows"))
        state.info["output_seconds"] = time.perf_counter() - t0  # the record's cost split (issue 40 item 4)
