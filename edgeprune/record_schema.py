"""The schema of a run record (``run.json``; issue 41): every section a command reads back.

A run directory is user input (copied, edited, damaged). :func:`check_record` checks the record
once, where it is loaded (:func:`edgeprune.artifact.read_record` through
:func:`edgeprune.run_record.validate_record`), against :data:`RECORD_SCHEMA`: the base model,
the per-block dims (``blocks``, ``dense_blocks``), the weights' hash, ``calibration`` (heal reads
its size), ``allocation`` (``info`` prints its budget, costs, proxy errors and per-block dims;
its ``latency`` and ``selection`` parts), ``embed`` (``load_run`` rebuilds the sliced width from
it, heal refuses it), ``head`` (NuWa), ``evaluation`` (heal reuses it), ``sparsity``, counts,
timing, the latency check and the other sections' fields. A field of the wrong type, a missing
required field or a non-finite number is one line naming the file and the field
(``runs/x/run.json: field 'allocation.blocks[0].dims' must be an object of integer >= 0 values,
got "x" (the run directory is damaged ...)``), so that ``info``, ``eval``, ``export``, ``heal``
and ``quantize`` never meet an ``AttributeError`` / ``KeyError`` / ``TypeError`` later.

Sections that are absent keep their meaning of older records (no allocation: a sparsity run; no
``weights_sha256``: not checked; ...). Keys the schema does not name are kept and not checked
(informational entries such as ``solve`` or ``allocation.selection.sensitivity``).
"""

from __future__ import annotations

import os
from typing import Any

from edgeprune.errors import UserError
from edgeprune.schema import Bool, Int, ListOf, MapOf, Num, Obj, OneOf, Req, SchemaError, Str, check

__all__ = ["RECORD_SCHEMA", "BLOCK_INT_KEYS", "check_record", "DAMAGED_HINT"]

#: the message's parentheses for a damaged record
DAMAGED_HINT = "the run directory is damaged or was edited: prune / derive it again into a new -o"

#: per-block entries ``edgeprune.surgery.apply_structure`` reads (integers >= 0)
BLOCK_INT_KEYS = ("num_heads", "qk_dim", "v_dim", "mlp_hidden")

_SHA256 = Str(want="a sha256 hex digest (64 characters 0-9a-f)", nullable=True)
_OBJ_OR_NULL = Obj({}, nullable=True, want="an object")
_COUNT = Num(ge=0, want="a finite number >= 0")
_METRICS = MapOf(Num(), nullable=True)


def _sha_ok(d: dict, name: str, field: str) -> None:
    """``d[name]``, a string or null by its node, is a sha256 hex digest."""
    v = d.get(name)
    if v is not None and (len(v) != 64 or any(c not in "0123456789abcdef" for c in v)):
        raise SchemaError(field, f"must be a sha256 hex digest (64 characters 0-9a-f) or null, got \"{v[:20]}\"")


def _base_sha_ok(d: dict, field: str) -> None:
    _sha_ok(d, "checkpoint_sha256", f"{field}.checkpoint_sha256")


_BASE_MODEL = Obj({
    "name": Req(Str(nonempty=True, want="a model name")),
    "checkpoint": Str(nullable=True, want="a path"),
    "checkpoint_sha256": _SHA256,
    "random_init": Bool(nullable=True),
    "seed": Int(nullable=True),
    "num_classes": Int(min=1, nullable=True),
    "img_size": Int(min=1, nullable=True),
    "model_kwargs": Obj({}, nullable=True),
    "input_size": ListOf(Int(min=1), min_len=3, max_len=3),
    "output_kind": Str(),
    "preprocessing": Obj({"mean": ListOf(Num()), "std": ListOf(Num(gt=0))}, nullable=True),
}, then=_base_sha_ok)

_BLOCK = Obj({**{k: Req(Int(min=0)) for k in BLOCK_INT_KEYS}, "index": Int(min=0),
              "head_dim": Int(min=1, nullable=True), "query_tokens": Int(min=1, nullable=True),
              "tokens": Int(min=1), "merge": Int(min=0)})

_CALIBRATION = Obj({"source": Str(nullable=True), "num_images": Int(min=0, nullable=True),
                    "size_requested": Int(min=1, nullable=True), "seed": Int(nullable=True),
                    "batch_size": Int(min=1, nullable=True), "passes": Int(min=0, nullable=True),
                    # the --calib folder (absolute) and its content hash (edgeprune.jobs.calib_reuse), issue 42
                    "folder": Str(nullable=True), "folder_sha256": Str(nullable=True),
                    "eval_folder": Str(nullable=True)})  # the --eval-data folder (absolute), issue 52

_BUDGET = Obj({"kind": Req(Str(nonempty=True)), "value": Req(Num(gt=0)), "unit": Str(nullable=True),
               "table": Str(nullable=True)})

_ALLOC_LATENCY = Obj({"table": Str(nullable=True), "key": Obj({}), "rules": Obj({}),
                      "predicted": Num(ge=0), "target": Num(gt=0), "dense": Num(gt=0),
                      "dense_predicted_ms": Num(gt=0), "dense_measured_ms": Num(gt=0, nullable=True)}, nullable=True)

_SELECTION = Obj({"chosen": Req(Str()), "images": Req(Int(min=0)), "measured_output_error": Req(MapOf(Num(ge=0))),
                  "proxy_error": MapOf(Num(ge=0)), "seconds": Num(ge=0), "rule_reused": Str()}, nullable=True)

_ALLOCATION = Obj({
    "budget": Req(_BUDGET),
    "target_cost": Req(_COUNT), "dense_cost": _COUNT, "achieved_cost": _COUNT,
    "flops": Req(_COUNT), "params": Req(_COUNT), "dense_flops": _COUNT, "dense_params": _COUNT,
    "flops_fraction": Req(_COUNT), "params_fraction": Req(_COUNT),
    "chosen": Req(Str()),
    "proxy_error": Req(MapOf(Num(ge=0))),
    "within_tolerance": Bool(),
    "blocks": Req(ListOf(Obj({"index": Req(Int(min=0)), "dims": Req(MapOf(Int(min=0))),
                              "proxy_error": MapOf(Num(ge=0))}))),
    "selection": _SELECTION,
    "latency": _ALLOC_LATENCY,
}, nullable=True)


def _embed_ok(d: dict, field: str) -> None:
    if d["embed_dim"] > d["dense_embed_dim"]:
        raise SchemaError(f"{field}.embed_dim", f"must be <= embed.dense_embed_dim ({d['dense_embed_dim']}), "
                          f"got {d['embed_dim']}")


_EMBED = Obj({"embed_dim": Req(Int(min=2)), "dense_embed_dim": Req(Int(min=2)), "eps": Num(gt=0),
              "sparsity": Num(ge=0, le=1), "rotation": Str(), "kept_energy": Num(ge=0), "images": Int(min=0),
              "seconds": Num(ge=0)}, nullable=True, then=_embed_ok)

_EMBED_AUTO = Obj({"chosen": Num(ge=0, le=1), "embed_dim": Int(min=2), "images": Int(min=0),
                   "candidates": ListOf(Obj({"embed_sparsity": Num(ge=0, le=1), "embed_dim": Int(min=2),
                                             "check_error": Num(ge=0)}))}, nullable=True)

#: token merging (edgeprune.tokens): load_run re-applies ``r``
_TOKENS_MERGE = Obj({"schedule": OneOf(Int(min=0), Str(), ListOf(Int(min=0))), "r": Req(ListOf(Int(min=0))),
                     "tokens": ListOf(Int(min=1)), "output_tokens": Int(min=1),
                     "unmerge": Bool(nullable=True)}, nullable=True)  # issue 55: merged inside blocks, unmerged

_HEAD = Obj({"classes": ListOf(Int(min=0)), "num_classes": Int(min=1, nullable=True), "mode": Str()}, nullable=True)

_EVALUATION = Obj({"data": Str(nullable=True), "dense": _METRICS, "pruned": _METRICS, "before_healing": _METRICS,
                   "device": Str()}, nullable=True)

_LATENCY_CHECK = Obj({"predicted_ms": Num(ge=0), "budget_ms": Num(gt=0), "dense_predicted_ms": Num(gt=0),
                      "measured": Obj({"dense_ms": Num(gt=0), "pruned_ms": Num(gt=0), "ratio": Num(gt=0),
                                       "pairs": Int(min=1), "ratio_interval": ListOf(Num(gt=0), min_len=2, max_len=2),
                                       "stopped": Str(choices=("settled", "verdict known", "pair limit")),
                                       # issue 52: the clock and the machine's load (edgeprune.latency.load)
                                       "clock": Str(choices=("wall", "cpu")),
                                       "load": Obj({"dense_spread": Num(ge=0, nullable=True),
                                                    "loaded": Str(nullable=True)})},
                                      nullable=True),
                      "meets_budget": Bool(nullable=True), "backend": Str(nullable=True),
                      "loaded": Str(nullable=True),
                      # issue 40: the measure-and-correct rounds (edgeprune.budget.correction_loop)
                      "rounds": ListOf(Obj({"round": Req(Int(min=0)), "budget_value": Num(gt=0),
                                            "predicted": Num(gt=0), "measured": Num(gt=0), "miss": Num()})),
                      "chosen_round": Int(min=0), "tolerance": Num(gt=0), "max_rounds": Int(min=0)},
                     nullable=True)

_BIAS = Obj({"kind": Str(), "images": Int(min=0), "shift_norm": Num(ge=0), "skipped": Str(nullable=True),
             "weight_change": Num(ge=0), "alpha": OneOf(Num(gt=0), Str(), nullable=True)}, nullable=True)

_SETTINGS = Obj({"gram_tokens_used": Int(min=0), "class_token_blocks": MapOf(Int(min=1)),
                 "round_to": Int(min=1)}, nullable=True)

_CONFIG = Obj({"embed_order": Str(choices=("first", "last")), "embed_refit": Bool(), "target": Str(nullable=True),
               "round_to": Int(min=1)}, nullable=True)


def _blocks_match(d: dict, field: str) -> None:
    dense = d.get("dense_blocks")
    if dense is not None and len(dense) != len(d["blocks"]):
        raise SchemaError("dense_blocks", f"must have one entry per block ({len(d['blocks'])}), has {len(dense)}")
    _sha_ok(d, "weights_sha256", "weights_sha256")


RECORD_SCHEMA = Obj({
    "edgeprune_version": Str(nullable=True),
    "base_model": Req(_BASE_MODEL),
    "method": Str(nullable=True), "targets": Str(nullable=True),
    "sparsity": MapOf(OneOf(Num(ge=0, le=1), Str()), nullable=True),
    "achieved_sparsity": MapOf(Num(ge=0, le=1), nullable=True),
    "blocks": Req(ListOf(_BLOCK)),
    "dense_blocks": ListOf(_BLOCK),
    "weights_sha256": _SHA256,
    "params": _COUNT, "dense_params": _COUNT, "flops": _COUNT, "dense_flops": _COUNT,
    "calibration": _CALIBRATION,
    "allocation": _ALLOCATION,
    "embed": _EMBED,
    "embed_auto": _EMBED_AUTO,
    "tokens_merge": _TOKENS_MERGE,
    "head": _HEAD,
    "evaluation": _EVALUATION,
    "latency_check": _LATENCY_CHECK,
    "bias_correction": _BIAS,
    "settings": _SETTINGS,
    "config": _CONFIG,
    "sections": MapOf(Obj({}, want="an object"), nullable=True),  # issue 53: the declared settings (informational)
    "timing": Obj({"total_s": Num(ge=0), "calibration_s": Num(ge=0), "solve_s": Num(ge=0),
                   "split": MapOf(Num(ge=0))}, nullable=True),  # issue 40: the budgeted prune's cost split
    "healing": _OBJ_OR_NULL, "derivation": _OBJ_OR_NULL,
    "device": Str(nullable=True), "created": Str(nullable=True),
}, then=_blocks_match)


def check_record(rec: Any, path: str | os.PathLike) -> dict:
    """``rec`` (a parsed ``run.json``) if it fits :data:`RECORD_SCHEMA`.

    Raises:
        UserError: one line: a record that is not a JSON object (``null``, a list, ...) says what
            the file should be and how to get one; else the first field that does not fit.
    """
    if not isinstance(rec, dict):
        raise UserError(f"{path} is not a run record: it should be the JSON object that edgeprune prune, derive "
                        "or heal writes beside model.safetensors (the run directory is damaged: prune / derive it "
                        "again into a new -o)")
    return check(RECORD_SCHEMA, rec, str(path), DAMAGED_HINT)
