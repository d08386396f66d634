"""The plan of a deploy: per stage its settings (hashed into ``stages.json``), its inputs, its outputs, what
it does, and the job that runs it (:mod:`edgeprune.jobs`), or why it is skipped / where the deploy stops.

The settings dicts are those the deploy has hashed since issue 42 (an earlier deploy's folder is reused).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Callable

from edgeprune.deploy.heal import heal_step
from edgeprune.deploy.state import hash_paths
from edgeprune.jobs.bench import bench
from edgeprune.jobs.build import build
from edgeprune.jobs.export import export
from edgeprune.jobs.models import torch_device_of
from edgeprune.jobs.prune_run import prune_run
from edgeprune.jobs.verify import VerifyFailed, verify
from runners.registry import backend_available

#: ``recipe(command, given, path, values, record=None)``: writes a stage's recipe file (the CLI's)
Recipe = Callable[..., Any]


def plan(o: dict[str, Any], recipe: Recipe | None = None) -> dict[str, dict[str, Any]]:
    """Per stage: ``settings`` (hashed), ``inputs`` (``{label: path}``, hashed in order), ``outputs`` (under
    OUT), ``run`` (no arguments), ``what``, ``command`` (the line to run it on the device: build, bench);
    or ``skip`` (why) / ``stop`` (why it stops there)."""
    out, profile, prec = o["out"], o["profile"], o["precision"]
    run, onnx, dense = out / "run", out / "model.onnx", out / "dense.onnx"
    final_run = out / "healed" if o["heal"] else run
    model_keys = ("model_name", "checkpoint", "random_init", "num_classes", "img_size", "model_kwargs")
    model = {k: o[k] for k in model_keys}
    data = {k: o[k] for k in ("calib_dir", "calib_size", "seed", "eval_data", "eval_size")}
    steps: dict[str, dict[str, Any]] = {}
    prune = {**model, **data, "batch_size": o["batch_size"], o["budget"]: o[o["budget"]],
             "latency_table": o["latency_table"], "torch_device": o["torch_device"],
             **({"tokens_merge": o["tokens_merge"]} if o["tokens_merge"] is not None else {})}  # older hashes kept
    inputs = {"--checkpoint": o["checkpoint"], "--latency-table": o["latency_table"], **_data_listings(o)}
    steps["prune"] = {"settings": prune, "inputs": inputs, "outputs": ["run"],
                      "what": f"prune {o['model_name']} with a {o['budget']} budget of {o[o['budget']]}",
                      "run": lambda: _prune(o, run, prune, recipe)}
    steps["heal"] = heal_step(o, run, out / "healed", _listing, recipe)
    steps["export"] = {"settings": {**model, "opset": 17}, "inputs": {f"{final_run.name}/": final_run},
                       "outputs": ["model.onnx", "dense.onnx"],
                       "what": "export the pruned and the dense model to ONNX (opset 17, dynamic batch)",
                       "run": lambda: _export(o, final_run, onnx, dense, model)}
    n = o["eval_size"] or 64
    steps["verify"] = {"settings": {"n": n, "eval_data": o["eval_data"]},
                       "inputs": {f"{final_run.name}/": final_run, onnx.name: onnx},
                       "outputs": ["verify.json"], "what": f"ONNX Runtime vs PyTorch on up to {n} evaluation images",
                       "run": lambda: _verify(o, onnx, final_run, n)}
    final = onnx if prec == "fp32" else out / f"model-{prec}.onnx"
    steps["quantize"] = _quantize_step(o, onnx, final, recipe)
    engine = out / "model.engine"
    steps["build"] = _build_step(o, final, engine)
    target = engine if profile.uses_tensorrt else final
    steps["bench"] = _bench_step(o, target, dense)
    return steps


def _listing(path: Any) -> str | None:
    """A data folder as a cheap hash of its listing (paths, sizes, times), or None."""
    return None if path is None else f"listing:{hash_paths([path], content=False)}"


def _data_listings(o: dict[str, Any]) -> dict[str, str | None]:
    """The inputs ``--calib`` and ``--eval-data`` of a stage, as :func:`_listing` hashes them."""
    return {"--calib": _listing(o["calib_dir"]), "--eval-data": _listing(o["eval_data"])}


def _prune(o: dict[str, Any], run: Path, prune: dict[str, Any], recipe: Recipe | None) -> None:
    given = {k: v for k, v in prune.items() if v is not None}
    writer = None if recipe is None else (
        lambda path, values, record: recipe("prune", {"out": str(run), "quiet": o["quiet"], **given}, path, values,
                                            record))
    prune_run(str(run), quiet=o["quiet"], echo=o["echo"], write_recipe=writer, **given)


def _export(o: dict[str, Any], run: Path, onnx: Path, dense: Path, model: dict[str, Any]) -> None:
    """The pruned run to ``onnx`` and the dense model (the model options) to ``dense`` (for the bench)."""
    export(onnx, run_dir=run, force=True, echo=o["echo"])
    export(dense, force=True, echo=o["echo"], **{k: v for k, v in model.items() if v})


def _verify(o: dict[str, Any], onnx: Path, run: Path, n: int) -> None:
    result = verify(onnx, run_dir=run, n=n, data=o["eval_data"], json_out=o["out"] / "verify.json",
                    torch_device=torch_device_of(None, None, default="cpu"), echo=o["echo"])
    if not result.passed:
        raise VerifyFailed(f"{onnx}: ONNX Runtime and PyTorch differ beyond the tolerance ({o['out'] / 'verify.json'})")


def _quantize_step(o: dict[str, Any], onnx: Path, final: Path, recipe: Recipe | None) -> dict[str, Any]:
    prec, profile = o["precision"], o["profile"]
    if prec == "fp32":
        return {"skip": f"the {profile.name} profile runs fp32: the exported model.onnx is deployed as it is"}
    mode = "dynamic" if prec == "int8" and not profile.uses_tensorrt else "static"
    kind = "tensorrt" if prec == "int8" and mode == "static" else "auto"
    given = {"model": onnx, "precision": prec, "output": final, "mode": mode, "recipe": kind, "force": True,
             "json_out": o["out"] / "quantize.json", "calib_dir": o["calib_dir"], "calib_size": o["calib_size"],
             "seed": o["seed"], "eval_data": o["eval_data"], "eval_size": o["eval_size"]}
    given = {k: v for k, v in given.items() if v is not None}
    settings = {k: str(v) for k, v in given.items() if k not in ("model", "output", "json_out", "force")}
    outputs = [final.name, "quantize.json"] + ([final.name + ".recipe.toml"] if recipe is not None else [])
    how = f" ({mode}, {kind} recipe)" if mode == "static" and prec == "int8" else f" ({mode})" * (prec == "int8")

    def run() -> None:
        from edgeprune.jobs.quantize import quantize  # onnxruntime: imported when quantizing

        writer = None if recipe is None else (lambda path, values: recipe("quantize", given, path, values))
        quantize(**given, echo=o["echo"], write_recipe=writer)

    return {"settings": settings, "inputs": {onnx.name: onnx, **_data_listings(o)},
            "outputs": outputs, "what": f"quantize to {prec}" + how, "run": run}


def _build_step(o: dict[str, Any], final: Path, engine: Path) -> dict[str, Any]:
    profile = o["profile"]
    if not profile.uses_tensorrt:
        return {"skip": f"the {profile.name} profile runs {profile.backend}: no engine to build"}
    missing = backend_available("tensorrt")
    if missing is not None:
        cmd = shlex.join(["edgeprune", "build", str(final), "--device", o["profile_name"], "-o", str(engine)])
        return {"stop": f"stopped before build: TensorRT is not usable here ({missing})", "command": cmd}
    return {"settings": {"profile": profile.to_dict()}, "inputs": {final.name: final},
            "outputs": [engine.name, engine.name + ".json"],
            "what": f"build a TensorRT engine for {profile.name} ({o['precision']})",
            "run": lambda: build(final, device=o["profile_name"], output=engine, echo=o["echo"])}


def _bench_step(o: dict[str, Any], target: Path, dense: Path) -> dict[str, Any]:
    if not o["bench"]:
        return {"skip": "--no-bench"}
    profile, out = o["profile"], o["out"]
    settings = {"profile": profile.to_dict(), "iterations": o["bench_iterations"], "memory": "per model"}
    cmd = ["edgeprune", "bench", str(target), "--vs", str(dense), "--device", o["profile_name"],
           *(["--iterations", str(o["bench_iterations"])] if o["bench_iterations"] is not None else []),
           "--json", str(out / "bench.json"), "--markdown", str(out / "bench.md")]
    return {"settings": settings, "inputs": {target.name: target, dense.name: dense},
            "outputs": ["bench.json", "bench.md"], "command": shlex.join(cmd),
            "what": f"bench {target.name} vs dense.onnx on {profile.name} ({profile.backend}, interleaved)",
            "run": lambda: bench(str(target), str(dense), device=o["profile_name"], iterations=o["bench_iterations"],
                                 json_out=out / "bench.json", md_out=out / "bench.md", echo=o["echo"])}


__all__ = ["Recipe", "plan"]
