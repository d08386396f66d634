"""One registry implementation for every kind (issue 53, item 5): :class:`edgeprune.registry.Registry`.

The generic class (register / get / the one-line unknown error / duplicates / unregister / listing), each of
the nine registries being one, and a gate that fails on a tenth registry kept as a bare module-level dict.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from edgeprune.errors import UserError
from edgeprune.registry import Registry

ROOT = Path(__file__).resolve().parents[1]


def _toy() -> Registry[int]:
    reg: Registry[int] = Registry("toy kind")
    reg.register("b", 2)
    reg.register("a", 1)
    return reg


# ---- the generic class ---------------------------------------------------------------------------


def test_register_get_and_listing_keep_registration_order():
    reg = _toy()
    assert reg.get("a") == 1 and reg["b"] == 2 and reg.find("a") == 1 and reg.find("c") is None
    assert reg.find("c", 7) == 7
    assert reg.names() == ("b", "a") and list(reg) == ["b", "a"] and reg.items() == (("b", 2), ("a", 1))
    assert "a" in reg and "c" not in reg and len(reg) == 2 and reg.kind == "toy kind"
    assert reg.decorator("c")(3) == 3 and reg.get("c") == 3 and reg.names() == ("b", "a", "c")


def test_unknown_name_is_one_user_error_line_naming_the_known_ones():
    reg = _toy()
    with pytest.raises(UserError) as e:
        reg.get("zzz")
    assert str(e.value) == "unknown toy kind 'zzz', known: b, a"
    assert "\n" not in str(e.value) and e.value.__cause__ is None
    with pytest.raises(UserError, match=r"^unknown toy kind 'zzz', known: b, a$"):
        reg["zzz"]
    assert str(reg.unknown("q", ("x", "y"), "other kind")) == "unknown other kind 'q', known: x, y"
    assert str(Registry("empty").unknown("q")) == "unknown empty 'q', known: (none registered)"


def test_duplicate_is_a_one_line_value_error_unless_replace():
    reg = _toy()
    with pytest.raises(ValueError, match=r"^toy kind 'a' is already registered") as e:
        reg.register("a", 9)
    assert "\n" not in str(e.value) and reg.get("a") == 1
    with pytest.raises(ValueError, match="already registered"):
        reg.decorator("a")(9)
    assert reg.register("a", 9, replace=True) == 9 and reg.get("a") == 9
    assert reg.names() == ("b", "a")  # replaced in place
    for bad in ("", None, 3):
        with pytest.raises(ValueError, match="non-empty name"):
            reg.register(bad, 0)  # type: ignore[arg-type]


def test_unregister_and_copy():
    reg = _toy()
    twin = reg.copy()
    reg.unregister("a")
    assert reg.names() == ("b",) and twin.names() == ("b", "a") and twin.kind == reg.kind
    with pytest.raises(ValueError, match=r"^toy kind 'a' is not registered"):
        reg.unregister("a")
    reg.unregister("a", missing_ok=True)
    with pytest.raises(UserError, match=r"^unknown toy kind 'a', known: b$"):
        reg.get("a")


# ---- the nine registries -------------------------------------------------------------------------

#: (module, attribute, the module importing the built-in entries, a public getter raising the unknown error)
NINE = [
    ("edgeprune.ranking.registry", "CRITERIA", "edgeprune.ranking", "get_criterion"),
    ("edgeprune.corp.qk_solvers", "SOLVERS", "edgeprune.corp", "get_qk_solver"),
    ("edgeprune.pruning.stage", "STAGES", "edgeprune.pruning", None),
    ("edgeprune.zoo.entries", "ZOO", "edgeprune.zoo.registry", None),
    ("edgeprune.budget.registry", "COST_MODELS", "edgeprune.budget", "get_cost_model"),
    ("edgeprune.latency.measure", "TIMERS", "edgeprune.latency.measure", "get_timer"),
    ("exporters.quantization.weight_rounding", "WEIGHT_ROUNDING", "exporters.quantization", "get_weight_rounding"),
    ("exporters.quantization.registry", "RECIPES", "exporters.quantization", "get_recipe"),
    ("runners.registry", "BACKENDS", "runners", "get_backend"),
]


@pytest.mark.parametrize("module, attr, builtins, getter", NINE, ids=[a for _, a, _, _ in NINE])
def test_each_registry_is_a_registry_with_the_one_line_unknown_error(module, attr, builtins, getter):
    importlib.import_module(builtins)
    mod = importlib.import_module(module)
    reg = getattr(mod, attr)
    assert isinstance(reg, Registry) and len(reg) >= 2, (module, attr)
    want = rf"^unknown {re.escape(reg.kind)} 'no-such-name', known: (auto, )?{re.escape(', '.join(reg.names()))}$"
    with pytest.raises(UserError, match=want) as e:
        reg.get("no-such-name")
    assert "\n" not in str(e.value)
    if getter is not None:
        with pytest.raises(UserError) as e:
            getattr(mod, getter)("no-such-name")
        msg = str(e.value)
        assert "\n" not in msg and "'no-such-name', known: " in msg and all(n in msg for n in reg.names()), msg


def test_the_stage_anchor_error_lists_the_stages_in_run_order():
    from edgeprune.pruning import Stage, register_stage, stage_names

    with pytest.raises(UserError, match=rf"^unknown stage 'nope', known: {re.escape(', '.join(stage_names()))}$"):
        register_stage("x", after="nope")(type("X", (Stage,), {}))
    assert "x" not in stage_names()


# ---- the gate: no tenth registry kept as a bare dict ---------------------------------------------

_NAME = re.compile(r"^(_?REGISTRY|\w+_REGISTRY)$")
#: {"path NAME": reason} module-level containers a ``register*`` function fills that are not a registry
ALLOWED = {"edgeprune/pruning/stage.py _ORDER": "the run order of the stage names; the classes are in STAGES"}


def _module_containers(tree: ast.Module) -> dict[str, tuple[int, bool]]:
    """Module-level names bound to a dict (``{}``, ``dict()``, a dict display or comprehension, or annotated
    ``dict[...]``) or to an empty list: name -> (line, whether a dict)."""
    found: dict[str, tuple[int, bool]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value, ann = node.targets, node.value, None
        elif isinstance(node, ast.AnnAssign):
            targets, value, ann = [node.target], node.value, node.annotation
        else:
            continue
        is_dict = isinstance(value, (ast.Dict, ast.DictComp)) or (
            isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "dict")
        if ann is not None:
            head = ann.value if isinstance(ann, ast.Subscript) else ann
            is_dict = is_dict or (isinstance(head, ast.Name) and head.id in ("dict", "Dict"))
        is_list = isinstance(value, ast.List) and not value.elts
        for t in targets:
            if (is_dict or is_list) and isinstance(t, ast.Name):
                found[t.id] = (node.lineno, is_dict)
    return found


def _filled_by_register(tree: ast.Module, names: set[str]) -> set[str]:
    """Those of ``names`` that a ``register*`` function (or a function nested in one) stores into."""
    filled: set[str] = set()
    for fn in ast.walk(tree):
        if not (isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name.startswith("register")):
            continue
        for node in ast.walk(fn):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            for t in targets:
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id in names:
                    filled.add(t.value.id)
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in names
                    and node.func.attr in ("update", "setdefault", "append", "insert")):
                filled.add(node.func.value.id)
    return filled


def hand_rolled_registries(source: str, where: str = "<source>") -> list[str]:
    """``where:line NAME`` for each module-level dict of ``source`` that is a registry kept by hand: named
    ``REGISTRY`` / ``_REGISTRY`` / ``*_REGISTRY``, or (a dict or an empty list) filled by a ``register*``
    function."""
    tree = ast.parse(source)
    found = _module_containers(tree)
    filled = _filled_by_register(tree, set(found))
    return [f"{where}:{line} {name}" for name, (line, is_dict) in found.items()
            if (is_dict and _NAME.match(name)) or name in filled]


def test_the_detector_catches_a_planted_registry():
    assert hand_rolled_registries("MODEL_REGISTRY = {}\n") == ["<source>:1 MODEL_REGISTRY"]
    assert hand_rolled_registries("_REGISTRY: dict[str, int] = dict()\n") == ["<source>:1 _REGISTRY"]
    assert hand_rolled_registries("REGISTRY: 'dict' = {}\nx = 1\n") == ["<source>:1 REGISTRY"]
    planted = ("_THINGS: dict[str, type] = {}\n\n"
               "def register_thing(name):\n"
               "    def deco(cls):\n"
               "        _THINGS[name] = cls\n"
               "        return cls\n"
               "    return deco\n")
    assert hand_rolled_registries(planted) == ["<source>:1 _THINGS"]
    ordered = "ORDER: list = []\n\ndef register_step(name):\n    ORDER.insert(0, (name, None))\n"
    assert hand_rolled_registries(ordered) == ["<source>:1 ORDER"]
    clean = ("DEFAULTS = {'a': 1}\nREG = Registry('thing')\n\n"
             "def register_thing(name, cls):\n    REG.register(name, cls)\n\n"
             "def f():\n    DEFAULTS['b'] = 2\n")
    assert hand_rolled_registries(clean) == []


def test_no_module_keeps_a_registry_as_a_bare_dict():
    hits = []
    for pkg in ("edgeprune", "exporters", "runners"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel != "edgeprune/registry.py":
                hits += hand_rolled_registries(path.read_text(encoding="utf-8"), rel)
    seen = {re.sub(r":\d+ ", " ", h) for h in hits}
    assert set(ALLOWED) <= seen, f"allowlist entries no longer needed: {sorted(set(ALLOWED) - seen)}"
    hits = [h for h in hits if re.sub(r":\d+ ", " ", h) not in ALLOWED]
    assert hits == [], f"use edgeprune.registry.Registry instead of a dict: {hits}"
