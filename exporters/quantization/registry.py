"""Quantization recipes by name: the step of ``edgeprune quantize`` that writes the quantized model.

:func:`exporters.quantization.quantize.quantize_onnx` does what every recipe needs -- check the
paths, gather the calibration and evaluation images (:mod:`exporters.quantization.calibration`),
export a run directory, measure the result, gate it, write the metadata -- and hands the fp32 file
to the recipe that :meth:`~exporters.quantization.config.QuantizeConfig.recipe_name` picks, through
one :class:`RecipeJob`. The recipe writes ``job.quant_path`` and returns a :class:`Converted` (what
it did, for the metadata and the report).

Built-in recipes (one file each, registered at its end; ``exporters/quantization/__init__.py``
imports them):

* ``tensorrt`` (``recipe_tensorrt.py``) -- static int8 the TensorRT way: searched SmoothQuant,
  GPTQ weight rounding, searched clipping, measured fallback, Q/DQ written by hand;
* ``ort`` (``recipe_ort.py``) -- ONNX Runtime ``quantize_static`` (QDQ) or ``quantize_dynamic``;
* ``fp16`` (``recipe_fp16.py``) -- ONNX Runtime's float16 conversion.

A new recipe is one file with a :class:`Recipe` subclass and one ``register_recipe(MyRecipe())``
(tests/test_quantize_registry.py registers a toy one). The shape follows ONNX Runtime's
``quantization/registry.py`` and NVIDIA ModelOpt's registered modes: a name, what it serves, a run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import numpy as np

from edgeprune.registry import Registry

if TYPE_CHECKING:
    from exporters.quantization.config import QuantizeConfig


@dataclasses.dataclass
class Converted:
    """What a recipe did: node lists for the metadata and the report, and the tool used.

    Attributes:
        tool: one line naming the quantizer and its version (metadata ``quantization.tool``).
        excluded: node names kept float (metadata ``excluded_nodes``).
        attention: attention products kept float (ONNX Runtime recipe).
        smoothing: one report entry per smoothed site (recipe-specific keys).
        sensitivity: ``--auto-exclude``'s ranking, costliest first; ``auto``: the nodes it excluded.
        plan: the TensorRT recipe's per-GEMM plan (``Int8Plan.to_record``), or None.
    """

    tool: str
    excluded: list[str]
    attention: list[str] = dataclasses.field(default_factory=list)
    smoothing: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    sensitivity: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    auto: list[str] = dataclasses.field(default_factory=list)
    plan: dict[str, Any] | None = None


@dataclasses.dataclass
class RecipeJob:
    """One quantization handed to a recipe.

    Attributes:
        src: the user's input (file or run directory; for messages only).
        float_path: the fp32 ONNX file to quantize (read only).
        quant_path: where the recipe writes the quantized model (in ``workdir``).
        calib: (N, C, H, W) float32 preprocessed calibration images, or None when
            :meth:`Recipe.needs_calibration` said no.
        cfg: the validated settings.
        workdir: a temporary folder for intermediate files (removed afterwards).
        say: progress lines (the CLI prints them).
    """

    src: Path
    float_path: Path
    quant_path: Path
    calib: np.ndarray | None
    cfg: "QuantizeConfig"
    workdir: Path
    say: Callable[[str], None]


class Recipe:
    """A way to quantize: a name, the precisions / int8 modes it serves, and :meth:`run`.

    Subclasses set :attr:`name`, :attr:`precisions`, :attr:`modes` and override :meth:`run`;
    :meth:`needs_calibration` and :meth:`check` have defaults.
    """

    name: ClassVar[str] = ""
    #: ``QuantizeConfig.precision`` values it serves
    precisions: ClassVar[tuple[str, ...]] = ("int8",)
    #: ``QuantizeConfig.mode`` values it serves (fp16 runs in the default ``"static"``)
    modes: ClassVar[tuple[str, ...]] = ("static",)

    def serves(self, precision: str, mode: str) -> bool:
        """Whether ``--recipe NAME`` applies to this precision and mode (else the default recipe runs)."""
        return precision in self.precisions and mode in self.modes

    def needs_calibration(self, cfg: "QuantizeConfig") -> bool:
        """Whether :attr:`RecipeJob.calib` must hold calibration images (gathered before any work)."""
        return True

    def check(self, cfg: "QuantizeConfig") -> None:
        """Refuse settings the recipe cannot honour when it is named explicitly (``--recipe NAME``).

        Raises:
            UserError: a setting this recipe does not support.
        """

    def run(self, job: RecipeJob) -> Converted:
        """Write ``job.quant_path`` from ``job.float_path``; return what was done."""
        raise NotImplementedError


#: name -> the registered recipe (registering a name again replaces it)
RECIPES: Registry[Recipe] = Registry("int8 recipe")


def register_recipe(recipe: Recipe) -> Recipe:
    """Register ``recipe`` under ``recipe.name`` (replacing one of the same name); returns it.

    Raises:
        ValueError: an empty name or ``"auto"`` (reserved for the default choice).
    """
    if not recipe.name or recipe.name == "auto":
        raise ValueError(f"a recipe needs a name other than 'auto', got {recipe.name!r}")
    return RECIPES.register(recipe.name, recipe, replace=True)


def unregister_recipe(name: str) -> None:
    """Remove a registered recipe (tests register toys and take them away again; no error if there is none)."""
    RECIPES.unregister(name, missing_ok=True)


def get_recipe(name: str) -> Recipe:
    """The recipe registered as ``name``.

    Raises:
        UserError: an unknown name; one line listing ``auto`` and the registered ones.
    """
    if name not in RECIPES:
        raise RECIPES.unknown(name, ("auto", *RECIPES))
    return RECIPES.get(name)


__all__ = ["Converted", "RECIPES", "Recipe", "RecipeJob", "get_recipe", "register_recipe", "unregister_recipe"]
