"""The optional heal stage of ``edgeprune deploy`` (issue 42): ``edgeprune heal`` of the pruned run.

Between prune and export, ``--heal`` (or ``heal = true`` in the recipe's ``[heal]`` section) runs
``edgeprune heal``'s job (:func:`edgeprune.jobs.heal_run.heal_run`) on ``OUT/run`` with the deploy's calibration and
evaluation settings (the same images as the prune) and ``--heal-epochs`` / ``--heal-lr``, writing
``OUT/healed`` (a normal run directory whose record holds the ``healing`` entry). The export, the
verify and the report then use the healed run. An interrupted heal leaves its per-epoch checkpoint
in ``OUT/healed.partial`` and the rerun resumes it (``edgeprune heal``'s own resume), unless the
heal settings changed: then the stale checkpoint is removed first (``OUT/healed.partial.json``
holds the settings hash it was made with).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

from edgeprune.atomic import atomic_write_text
from edgeprune.deploy.state import hash_settings
from edgeprune.heal.settings import HealSection
from edgeprune.jobs.heal_run import heal_run

#: heal's own defaults (``edgeprune heal --epochs/--lr``: ``edgeprune.heal.settings``), for the stage's description
HEAL_DEFAULTS = {"epochs": HealSection.epochs, "lr": HealSection.lr}


def heal_step(o: dict[str, Any], run: Path, healed: Path, listing: Callable[[Any], str | None],
              recipe: Callable[..., Any] | None = None) -> dict[str, Any]:
    """The plan entry of the heal stage (see :func:`edgeprune.deploy.plan.plan`): ``skip`` without
    ``--heal``, else settings / inputs / outputs / run / what.

    ``listing`` hashes a data folder's listing; ``recipe(command, given, path, values)`` writes the healed
    run's recipe (the CLI's; None: no recipe file).
    """
    if not o.get("heal"):
        return {"skip": "not asked (--heal heals the pruned run with STARFISH before the export)"}
    given = {"run_dir": str(run), "out": str(healed), "calib_dir": o["calib_dir"], "calib_size": o["calib_size"],
             "seed": o["seed"], "batch_size": o["batch_size"], "eval_data": o["eval_data"],
             "eval_size": o["eval_size"], "epochs": o["heal_epochs"], "lr": o["heal_lr"],
             "torch_device": o["torch_device"]}
    given = {k: v for k, v in given.items() if v is not None}
    settings = {k: v for k, v in given.items() if k not in ("run_dir", "out")}
    epochs = given.get("epochs", HEAL_DEFAULTS["epochs"])
    lr = given.get("lr", HEAL_DEFAULTS["lr"])

    def run_heal() -> None:
        _drop_stale_checkpoint(healed, hash_settings(settings))
        writer = None if recipe is None else (lambda path, values: recipe("heal", {"quiet": o["quiet"], **given},
                                                                          path, values))
        heal_run(quiet=o["quiet"], echo=o["echo"], write_recipe=writer, **given)
        healed.with_name(healed.name + ".partial.json").unlink(missing_ok=True)

    return {"settings": settings,
            "inputs": {f"{run.name}/": run, "--calib": listing(o["calib_dir"]), "--eval-data": listing(o["eval_data"])},
            "outputs": [healed.name], "run": run_heal,
            "what": f"heal {run.name}/ with STARFISH ({epochs} epochs, lr {lr:g}) to {healed.name}/"}


def _drop_stale_checkpoint(healed: Path, settings: str) -> None:
    """Remove ``healed.partial`` when it was made with other heal settings; note the current ones."""
    partial, marker = healed.with_name(healed.name + ".partial"), healed.with_name(healed.name + ".partial.json")
    try:
        before = json.loads(marker.read_text(encoding="utf-8")).get("settings") if marker.is_file() else None
    except ValueError:
        before = None
    if partial.exists() and before != settings:
        shutil.rmtree(partial, ignore_errors=True)
    atomic_write_text(marker, json.dumps({"settings": settings}) + "\n")


def heal_summary(out: Path) -> dict[str, Any] | None:
    """The report's heal entry from ``OUT/healed/run.json`` (None without a heal): loss kind, the
    alignment loss before -> after (as ``edgeprune heal`` reports it), epochs, the kept epoch,
    steps, layers and parameters trained, seconds, and the quality before healing."""
    path = out / "healed" / "run.json"
    if not path.is_file():
        return None
    rec = json.loads(path.read_text(encoding="utf-8"))
    h = rec.get("healing") or {}
    cfg = h.get("config") or {}
    ev = rec.get("evaluation") or {}
    hold = (h.get("holdout") or {}).get("num_images")
    return {"loss": cfg.get("loss"), "initial_loss": h.get("initial_loss"), "final_loss": h.get("final_loss"),
            "epochs": cfg.get("epochs"), "lr": cfg.get("lr"), "best_epoch": h.get("best_epoch"),
            "steps": h.get("steps"), "layers": len(h.get("trained_modules") or []),
            "trainable_params": h.get("trainable_params"), "wall_time_s": h.get("wall_time_s"),
            "loss_on": f"{hold} held-out calibration images" if hold else "the calibration set",
            "before_healing": ev.get("before_healing")}


def heal_markdown(h: dict[str, Any]) -> str:
    """One line for ``report.md``: the alignment loss before -> after and what was trained."""
    def f(v: Any) -> str:
        return "n/a" if v is None else f"{v:.5f}"

    kept = f", kept epoch {h['best_epoch']}" if h.get("best_epoch") is not None else ""
    return (f"Healed (STARFISH): alignment loss ({h.get('loss')}) on {h['loss_on']} {f(h.get('initial_loss'))} -> "
            f"{f(h.get('final_loss'))}; {h.get('layers')} layers ({h.get('trainable_params') or 0:,} params), "
            f"{h.get('epochs')} epochs{kept}.")


__all__ = ["HEAL_DEFAULTS", "heal_markdown", "heal_step", "heal_summary"]
