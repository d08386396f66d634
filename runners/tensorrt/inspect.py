"""Engine inspection: layer listing and whether TensorRT fused the attention.

:func:`detect_attention_fusion` is pure (engine-inspector JSON -> :class:`FusionReport`) and
testable without a GPU; :func:`engine_information` and :func:`attention_fusion_report` load an
engine and ask TensorRT's ``IEngineInspector`` (layers in detail when the engine was built with
``ProfilingVerbosity.DETAILED``, as :func:`exporters.tensorrt.build_engine` does).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Mapping

from runners.tensorrt.engine import load_engine


# ============================================================================================
# attention fusion (pure)

# Signs of a fused multi-head-attention kernel in a layer's type, name or tactic: TensorRT's
# fused MHA ("_gemm_mha_v2", "fmha", LayerType "mha"), FlashAttention-style kernels, and the
# BERT QKVToContext plugin. ONNX node names in "Metadata" are not searched (they name the
# source ops, e.g. "scaled_dot_product_attention", whether or not they were fused).
_FUSED_RE = re.compile(
    r"(fmha|fused_?mha|_mha\b|_mha_|\bmha_|mha_v2|flash_?att|qkvtocontext|multiheadattention)",
    re.IGNORECASE,
)
_FUSED_TYPES = {"mha", "fmha", "attention", "multiheadattention"}
_SOFTMAX_RE = re.compile(r"soft_?max", re.IGNORECASE)
_MYELIN_RE = re.compile(r"(\{ForeignNode\[|^__myl_|^__mye|_myl\d+_\d+$)")


@dataclasses.dataclass
class FusionReport:
    """What the engine inspector says about attention.

    Attributes:
        verdict: ``"fused"`` (fused MHA kernels, no separate softmax), ``"partial"`` (both),
            ``"unfused"`` (separate softmax layers, no fused MHA), ``"opaque"`` (attention sits
            in a Myelin region whose inside is not listed: build with detailed profiling
            verbosity), or ``"unknown"`` (no layer information).
        fused_layers: names of layers that look like fused attention.
        softmax_layers: names of stand-alone softmax layers.
        myelin_layers: number of Myelin-generated layers / foreign nodes.
        n_layers: number of layers listed.
        detailed: whether the listing had per-layer details (type, tactic).
    """

    verdict: str
    fused_layers: list[str]
    softmax_layers: list[str]
    myelin_layers: int
    n_layers: int
    detailed: bool

    @property
    def fused(self) -> bool:
        return self.verdict in ("fused", "partial")

    def summary(self) -> str:
        base = {
            "fused": f"attention fused: {len(self.fused_layers)} fused MHA layer(s), no separate softmax",
            "partial": (f"attention partly fused: {len(self.fused_layers)} fused MHA layer(s), "
                        f"{len(self.softmax_layers)} separate softmax layer(s)"),
            "unfused": (f"attention NOT fused: {len(self.softmax_layers)} separate softmax layer(s), "
                        "no fused MHA kernel"),
            "opaque": (f"attention inside {self.myelin_layers} Myelin region(s) not itemised: "
                       "rebuild with profiling verbosity DETAILED to tell"),
            "unknown": "no attention information in the engine's layer listing",
        }[self.verdict]
        return f"{base} ({self.n_layers} layers listed)"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["summary"] = self.summary()
        return d


def _layer_fields(layer: Any) -> tuple[str, str, str]:
    """(name, layer type, tactic name) of one inspector entry (a dict, or a bare name)."""
    if isinstance(layer, str):
        return layer, "", ""
    if isinstance(layer, Mapping):
        return (str(layer.get("Name", "")), str(layer.get("LayerType", "")),
                str(layer.get("TacticName", "") or ""))
    return str(layer), "", ""


def detect_attention_fusion(info: str | Mapping[str, Any]) -> FusionReport:
    """Classify attention fusion from ``EngineInspector.get_engine_information(JSON)`` output.

    Args:
        info: the JSON text or the parsed dict (``{"Layers": [...], "Bindings": [...]}``);
            layers are dicts (detailed verbosity) or names (layer-names-only verbosity).

    Raises:
        ValueError: text that is not JSON, or JSON without a ``Layers`` list.
    """
    data: Any = json.loads(info) if isinstance(info, str) else info
    if not isinstance(data, Mapping) or not isinstance(data.get("Layers"), list):
        raise ValueError("engine information has no 'Layers' list")
    layers: list[Any] = list(data["Layers"])
    fused: list[str] = []
    softmax: list[str] = []
    myelin = 0
    detailed = any(isinstance(layer, Mapping) and "LayerType" in layer for layer in layers)
    for layer in layers:
        name, ltype, tactic = _layer_fields(layer)
        if ltype.lower() == "myelin" or _MYELIN_RE.search(name):
            myelin += 1
        if ltype.lower() in _FUSED_TYPES or _FUSED_RE.search(ltype) or _FUSED_RE.search(tactic) \
                or _FUSED_RE.search(name):
            fused.append(name)
        elif ltype.lower() == "softmax" or _SOFTMAX_RE.search(name) or _SOFTMAX_RE.search(tactic):
            softmax.append(name)
    if fused and softmax:
        verdict = "partial"
    elif fused:
        verdict = "fused"
    elif softmax:
        verdict = "unfused"
    elif myelin and not detailed:
        verdict = "opaque"
    else:
        verdict = "unknown"
    return FusionReport(verdict=verdict, fused_layers=fused, softmax_layers=softmax,
                        myelin_layers=myelin, n_layers=len(layers), detailed=detailed)


# ============================================================================================
# output comparison (pure)


def engine_information(engine_path: str | os.PathLike[str]) -> str:
    """The engine inspector's JSON (layers in detail if built with DETAILED verbosity).

    Raises:
        RuntimeFault: TensorRT is not installed.
        UserError: see :func:`runners.tensorrt.engine.load_engine`.
    """
    import tensorrt as trt

    runtime, engine, _version, logger = load_engine(engine_path)
    inspector = engine.create_engine_inspector()
    info = inspector.get_engine_information(trt.LayerInformationFormat.JSON)
    del inspector, engine, runtime, logger  # in this order: the engine before what it points to
    return info


def attention_fusion_report(engine_path: str | os.PathLike[str]) -> FusionReport:
    """Whether TensorRT fused attention in this engine (see :func:`detect_attention_fusion`)."""
    return detect_attention_fusion(engine_information(engine_path))


__all__ = ["FusionReport", "attention_fusion_report", "detect_attention_fusion", "engine_information"]
