"""The job of ``edgeprune derive``: NuWa class-specific derivation of a classifier under a FLOPs, params or latency
budget into a new run directory (``model.safetensors`` + ``run.json``), printed as the command prints it (the
params, MFLOPs and target-class top-1 of the base, anchor and derived models; the derivation's dims, budget and
timing; a latency budget's measured rounds). See :mod:`edgeprune.nuwa` and ``edgeprune.cli.derive``.

Every input is checked before any work (the budget and its table, the settings, the output, the data folders, the
model, the classes). The job's settings are its keywords (the command's options, ``--skp-steps`` = ``skp_steps``),
declared in :mod:`edgeprune.nuwa.settings` (the budget, :class:`~edgeprune.nuwa.settings.NuwaSection`, the
correction); the measure-and-correct loop of a latency budget is a :class:`~edgeprune.budget.correction.Correction`
or its three keywords. The run's ``recipe.toml`` is the CLI's: ``write_recipe(path, values, record)`` is called when
given.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from edgeprune.artifact import check_new_dir, save_run
from edgeprune.budget.correction import Correction
from edgeprune.settings import SettingError
from edgeprune.errors import UserError
from edgeprune.jobs.echo import Echo, echo as _echo
from edgeprune.jobs.models import check_readable_dir, make_spec, torch_device_of
from edgeprune.nuwa.config import DeriveConfig
from edgeprune.nuwa.derive import check_budget, derive
from edgeprune.nuwa.head import num_classes as head_classes
from edgeprune.nuwa.inputs import evaluate_targets, resolve_budget, resolve_classes
from edgeprune.nuwa.settings import NuwaSection
from edgeprune.budget.latency_check import latency_report
from edgeprune.zoo.labeled import class_names, load_labeled, load_labeled_eval


@dataclasses.dataclass
class DeriveRunResult:
    """Outcome of :func:`derive_run`: the run directory written and its record."""

    out: Path
    record: dict[str, Any]


def _correction(correction: Correction | None, keywords: Correction) -> Correction:
    """``correction``, or the section of its keywords (None = not given: the section's default), checked.

    Raises:
        UserError: both given; SettingError: a bad value, named by its keyword.
    """
    given = {k: v for k, v in keywords.items() if v is not None}
    if correction is not None:
        if given:
            raise UserError(f"derive_run: give correction= or its keywords, not both ({', '.join(given)})")
        return correction.validate().resolved()
    return Correction(**given).validate().resolved()


def _refuse_unread(correction: Correction | None, keywords: Correction, latency: Any) -> None:
    """The measure-and-correct settings given without a latency budget, refused as prune refuses them
    (``Correction.refuse_unread``); ``correction`` and its keywords both given: refused first.

    Raises:
        UserError: one line.
    """
    if correction is not None and any(v is not None for _k, v in keywords.items()):
        _correction(correction, keywords)  # both: refused (one line)
    (keywords if correction is None else correction).refuse_unread("latency" if latency is not None else None)


def _check_settings(budget: Any, train_per_class: int | None, correction: Correction | None,
                    corrections: Correction, nuwa: NuwaSection, inputs: dict[str, Any]) -> DeriveConfig:
    """The derivation's config (``nuwa``'s settings, the correction's and the job's ``inputs`` that are config
    fields), checked with the budget's inputs (a missing / malformed table: one line, before the model is built).

    Raises:
        UserError: a bad budget table, ``train_per_class`` < 1, a bad setting.
    """
    budget.check_inputs()
    if train_per_class is not None and train_per_class < 1:
        raise SettingError(f"{{train_per_class}} must be >= 1, got {train_per_class}")
    config = nuwa.config(_correction(correction, corrections), **inputs)
    config.validate()
    return config


def _measurer(replay: Any) -> Any:
    """A replay's measurer: ``replay`` itself (it has ``check``), or what the factory ``replay()`` returns."""
    return replay() if replay is not None and not hasattr(replay, "check") else replay


def derive_run(out: str | Path | None = None, *, model_name: str = "fmnist-vit", classes: str | Sequence[int | str],
               checkpoint: str | Path | None = None, random_init: bool = False, num_classes: int | None = None,
               img_size: int | None = None, model_kwargs: dict | None = None, flops: Any = None, params: Any = None,
               latency: Any = None, latency_table: str | Path | None = None, correction: Correction | None = None,
               verify_budget: bool | None = None, correction_tolerance: float | None = None,
               correction_rounds: int | None = None, slice_head: bool = False, data: str | None = None,
               train_data: str | None = None, train_per_class: int | None = None, calib_dir: str | None = None,
               calib_size: int = 128, val_size: int = 300, skp_steps: int = 400, skp_batch_size: int = 1,
               skp_eval_every: int = 50, lr_beta: float = 0.1, lr_mask: float = 1e-3, weight_decay: float = 0.05,
               rho: float | None = None, key_bias: str = "drop", ridge_alpha: float = 1e-4,
               eval_data: str | None = None, eval_size: int | None = None, no_eval: bool = False,
               no_cache: bool = False, seed: int = 0, threads: int | None = None, device: str | None = None,
               torch_device: str | None = None, quiet: bool = False, echo: Echo = _echo, replay: Any = None,
               write_recipe: Callable[[Path, dict[str, Any], dict[str, Any]], Any] | None = None) -> DeriveRunResult:
    """Derive a class-specific model of ``model_name`` for ``classes`` with NuWa into the new run directory ``out``
    (None: ``runs/<model>-nuwa-<classes>-<budget>[-slice]``), as ``edgeprune derive`` does.

    Args:
        classes: "0,3,7", "T-shirt/top,Bag", or a sequence of indices / names.
        flops, params, latency: exactly one budget, as prune parses it ("0.6", "2.3G", latency "0.5" or "12ms"
            with ``latency_table``).
        correction: the latency budget's measure-and-correct settings, or instead ``verify_budget``,
            ``correction_tolerance``, ``correction_rounds`` (None = the default).
        device, torch_device: the deployment profile's (old) torch-device spelling and the torch device
            (``edgeprune.jobs.models.torch_device_of``; default auto).
        replay: a recipe's recorded measurements (``edgeprune.cli.recipe_replay.ReplayMeasurer``: a measurer with
            ``check(record) -> line``), a zero-argument callable returning one or None (called once the checks
            passed), or None.
        write_recipe: ``(path, values, record)`` writes the run's recipe (the CLI's) or None.

    Raises:
        UserError: no or several budgets, a bad setting, ``out`` exists, unreadable data, an unknown model or one
            that is not a classifier, unknown classes, a budget the model cannot meet.
    """
    device = torch_device_of(device, torch_device, default="auto")
    corrections = Correction(verify_budget=verify_budget, correction_tolerance=correction_tolerance,
                             correction_rounds=correction_rounds)  # None = not given
    _refuse_unread(correction, corrections, latency)
    budget = resolve_budget(flops, params, latency=latency, table=latency_table)
    metric, amount, unit = budget.kind, budget.value, budget.unit or ""
    nuwa = NuwaSection(slice_head=slice_head, skp_steps=skp_steps, skp_batch_size=skp_batch_size,
                       skp_eval_every=skp_eval_every, lr_beta=lr_beta, lr_mask=lr_mask, weight_decay=weight_decay,
                       rho=rho, key_bias=key_bias, ridge_alpha=ridge_alpha, no_cache=no_cache)
    cfg = _check_settings(budget, train_per_class, correction, corrections, nuwa,
                          dict(val_size=val_size, calib_size=calib_size, seed=seed, device=device))
    if out is not None:
        check_new_dir(out)
    if threads is not None:
        torch.set_num_threads(threads)
    for path, what in ((data, "Fashion-MNIST data"), (train_data, "training data"), (calib_dir, "calibration data"),
                       (eval_data, "evaluation data")):
        check_readable_dir(path, what)
    spec = make_spec(model_name, checkpoint, random_init, num_classes, img_size, model_kwargs)
    if spec.output_kind != "logits":
        raise UserError(f"{model_name} is not a classifier; NuWa derives classifiers")
    base = spec.create(pretrained=True)
    names = class_names(spec, train_data)
    cls = resolve_classes(classes, head_classes(base), names)
    tag, sliced = "-".join(str(c) for c in cls), "-slice" if slice_head else ""
    out_path = check_new_dir(out or f"runs/{model_name}-nuwa-{tag}-{metric}{amount:g}{unit}{sliced}")
    check_budget(base, cls, budget, cfg, names)
    x, y, train_desc, calibration, ev = _data(spec, cls, data, train_data, train_per_class, calib_dir, calib_size,
                                              eval_data, eval_size, no_eval, seed)
    # the work
    echo(f"model {model_name}: classes {cls}" + (f" ({', '.join(names[c] for c in cls)})" if names else "")
         + f"; {metric} budget {amount:g}{unit}; labeled images: {train_desc}; device {cfg.device}")
    replay = _measurer(replay)  # a recipe's recorded measurements (issue 52)
    res = derive(base, cls, x, y, budget=budget, calibration=calibration, config=cfg,
                 class_names=names, spec=spec, progress=not quiet, measurer=replay)
    rec = res.record
    replayed = [replay.check(rec)] if replay is not None else []
    rec["derivation"]["data"]["train_source"] = train_desc
    rows = _evaluate(rec, base, res, ev, cls, slice_head, cfg.device, echo)
    save_run(out_path, res.model.cpu(), rec)
    if write_recipe is not None:  # issue 52: what the run measured, for an exact replay
        write_recipe(out_path / "recipe.toml", {"out": str(out_path)}, rec)
    _print_report(rec, rows, metric, f"{amount:g}{unit}", out_path, latency_report(rec.get("latency_check")) + replayed,
                  echo=echo)
    return DeriveRunResult(out=out_path, record=rec)


def _data(spec: Any, cls: list[int], data: str | None, train_data: str | None, train_per_class: int | None,
          calib_dir: str | None, calib_size: int, eval_data: str | None, eval_size: int | None, no_eval: bool,
          seed: int) -> tuple:
    """``(images, labels, description, calibration or None, evaluation (images, labels, description) or None)``:
    the labeled target-class training images, the unlabeled calibration images of ``calib_dir``, the evaluation
    images (none with ``no_eval``).

    Raises:
        UserError: missing or unreadable data, a target class without images.
    """
    x, y, train_desc = load_labeled(spec, data, train_data, cls, train_per_class, seed)
    calibration = None
    if calib_dir is not None:
        calibration = spec.calibration_source(calib_size, seed=seed, data=calib_dir, eval_data=eval_data)
    ev = None if no_eval else load_labeled_eval(spec, data, eval_data, cls, eval_size)
    return x, y, train_desc, calibration, ev


def _evaluate(rec: dict, base: Any, res: Any, ev: tuple | None, cls: list[int], slice_head: bool, device: str,
              echo: Echo) -> list[tuple]:
    """The report's rows ``(name, params, flops, target top-1 or None)`` of the base, anchor and derived models;
    with evaluation data ``ev`` (images, labels, description) each is evaluated on the target classes and
    ``rec["evaluation"]`` filled."""
    d = rec["derivation"]
    rows = [("base", rec["dense_params"], rec["dense_flops"], None),
            ("anchor", d["anchor"]["params"], d["anchor"]["flops"], None),
            ("derived", rec["params"], rec["flops"], None)]
    if ev is None:
        return rows
    ex, ey, edesc = ev
    m_base = evaluate_targets(base, ex, ey, cls, False, device=device)[0]
    m_anchor = evaluate_targets(res.anchor_model, ex, ey, cls, slice_head, device=device)[0]
    m_derived = evaluate_targets(res.model, ex, ey, cls, slice_head, device=device)[0]
    rec["evaluation"] = {"data": edesc, "metric": "top-1 over the target classes (argmax over them)",
                         "base": {"top1": m_base}, "anchor": {"top1": m_anchor}, "derived": {"top1": m_derived}}
    echo(f"evaluation: {edesc}")
    return [(r[0], r[1], r[2], m) for r, m in zip(rows, (m_base, m_anchor, m_derived))]


def _print_report(rec: dict, rows: list[tuple], metric: str, amount: str, out_path: Path, latency_lines: list[str],
                  echo: Echo = _echo) -> None:
    """The summary table (params, MFLOPs, target top-1 of base, anchor and derived), the
    derivation's dims, budget and timing, and a latency budget's measured rounds (``latency_lines``:
    ``latency_report``, as prune prints them; warnings on stderr)."""
    d = rec["derivation"]
    echo("")
    echo(f"| {'':8} | {'params':>10} | {'MFLOPs':>9} | target top-1 |")
    echo(f"|{'-' * 10}|{'-' * 12}|{'-' * 11}|--------------|")
    for name, p, f, m in rows:
        q = "-" if m is None else f"{m * 100:.2f}%"
        echo(f"| {name:8} | {p:>10,} | {f / 1e6:>9.2f} | {q:>12} |")
    b = d["budget"]
    echo(f"\nnuwa: rho={d['rho']:g} qk={d['ofp_mha']['qk']} vo={d['ofp_mha']['vo']} mlp={d['ofp_mlp']['mlp']}; "
         f"anchor kept {d['anchor']['kept']} (SKP step {d['anchor']['step']}); "
         f"{metric} x{b['achieved_fraction']:.3f} (budget {amount}); head: {rec['head']['mode']}; "
         f"SVD factors: {d['ofp_mha']['svd_cache']['source']}")
    if isinstance(b.get(metric), dict) and "predicted" in b[metric]:
        m = b[metric]
        echo(f"{metric}: predicted {m['predicted']:.3f} ms (target {m['target']:.3f}, dense {m['dense']:.3f}) "
             f"on {m.get('table')}; grid {m['round_to']}, rules {m['rules']}")
    t = rec["timing"]
    echo(f"time: SKP {t['skp_s']:.1f} s, statistics {t['stats_s']:.1f} s, SVD {t['svd_s']:.1f} s, "
         f"budget search {t['search_s']:.1f} s; total {t['total_s']:.1f} s")
    for line in latency_lines:
        echo(line, err=line.startswith("warning"))
    echo(f"saved {out_path}")


__all__ = ["DeriveRunResult", "derive_run"]
