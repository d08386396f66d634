"""Architecture rules of the project, checked on the source (pure ``ast``; issue 28).

(a) no import loop among the modules of edgeprune/, exporters/, runners/, devices/ (function-level
    imports included); (b) nothing outside ``edgeprune.cli`` imports it; (c) exporters and runners
    depend one way; (d) function-level imports of internal modules only for optional dependencies
    (count printed, ceiling below); (e) no file in edgeprune/, exporters/, runners/, devices/ over
    MAX_FILE_LINES lines; (f) no function there over MAX_FUNCTION_LINES lines except the allowlist;
    (g) no loop between packages; (h) no import from a lower layer to a higher one, the layer order
    being the ``layers`` block of docs/architecture.md, which places every package (issue 39); both
    except the allowlisted edges, which must still be needed.

The logic lives in ``tools/architecture_report.py`` (``python tools/architecture_report.py`` prints
the same numbers); the limits and allowlists are here, in one place, and nowhere else.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

# -- thresholds (tools/architecture_report.py reads these literals too) ----------------------------
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80
# Function-level imports of internal modules that are not optional-dependency modules (statements;
# 213 when issue 28 was filed). Imports at module top except for optional dependencies: 0.
MAX_FUNCTION_LEVEL_IMPORTS = 0
# {internal module or package: reason} that may be imported inside functions although its module
# level needs no optional dependency (a module that does is allowed without an entry).
LAZY_IMPORTS_ALLOWED: dict = {}
# {qualified function name (module.Class.function): reason} allowed over MAX_FUNCTION_LINES.
LONG_FUNCTIONS_ALLOWED: dict = {}
# {(importer module, target module): reason}: module edges left out of the package checks (g), (h) --
# uphill imports and package loops that remain in files being rewritten. One entry per edge; the test
# fails on an entry no longer needed (no such import, or neither uphill nor in a package loop).
PACKAGE_EDGES_ALLOWED: dict = {}
# -----------------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("architecture_report", ROOT / "tools" / "architecture_report.py")
arch = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("architecture_report", arch)
_spec.loader.exec_module(arch)


@pytest.fixture(scope="module")
def project():
    return arch.scan(ROOT)


@pytest.fixture(scope="module")
def layers():
    return arch.load_layers(ROOT)


def test_no_package_loop(project):
    loops = arch.package_loops(project, PACKAGE_EDGES_ALLOWED)
    assert not loops, f"{len(loops)} package loop(s):\n{arch.format_package_loops(loops)}"


def test_layers_place_every_package(project, layers):
    unplaced = arch.unplaced_packages(project, layers)
    assert not unplaced, f"packages without a line in the layers block of {arch.LAYERS_FILE}: {unplaced}"


def test_no_uphill_import(project, layers):
    found = arch.uphill_imports(project, layers, PACKAGE_EDGES_ALLOWED)
    assert not found, (f"{len(found)} import(s) from a lower layer to a higher one ({arch.LAYERS_FILE}):\n"
                       + arch.format_imports(found))


def test_package_edge_allowlist_is_current(project, layers):
    """Every allowlisted edge is still made by an import and is still uphill or in a package loop."""
    stale = arch.stale_allowed_edges(project, layers, PACKAGE_EDGES_ALLOWED)
    assert not stale, f"PACKAGE_EDGES_ALLOWED entries no longer needed (remove them): {stale}"
    assert all(isinstance(r, str) and r.strip() for r in PACKAGE_EDGES_ALLOWED.values())


def test_no_import_loop(project):
    loops = arch.import_loops(project)
    assert not loops, f"{len(loops)} import loop(s):\n{arch.format_loops(loops)}"


def test_no_core_module_imports_the_cli(project):
    found = arch.cli_imports(project)
    assert not found, "library code imports edgeprune.cli:\n" + "\n".join(
        f"  {i.where()}  {i.importer} -> {i.target}" for i in found)


def test_the_cli_imports_only_the_public_api_the_errors_and_the_settings(project):
    """Issue 53: ``edgeprune/cli/`` is a face of the library -- the package root's public names (the jobs, the
    profiles, ...), ``edgeprune.errors``, the settings declarations (``edgeprune.settings`` and every
    ``*settings`` module) and ``edgeprune.phases``; nothing else of the library."""
    found = arch.cli_library_imports(project)
    assert not found, "edgeprune.cli imports library internals:\n" + "\n".join(
        f"  {i.where()}  {i.importer} -> {i.target}" for i in found)


def test_exporters_and_runners_depend_one_way(project):
    e2r = arch.cross_imports(project, "exporters", "runners")
    r2e = arch.cross_imports(project, "runners", "exporters")
    fewer = e2r if len(e2r) <= len(r2e) else r2e
    assert not (e2r and r2e), (f"exporters -> runners {len(e2r)}, runners -> exporters {len(r2e)}; the fewer:\n"
                               + "\n".join(f"  {i.where()}  {i.importer} -> {i.target}" for i in fewer))


def test_function_level_imports_only_for_optional_dependencies(project):
    lazy = arch.function_level_imports(project, LAZY_IMPORTS_ALLOWED)
    print(f"function-level imports of internal modules not for an optional dependency: {len(lazy)} "
          f"(ceiling {MAX_FUNCTION_LEVEL_IMPORTS})")
    assert len(lazy) <= MAX_FUNCTION_LEVEL_IMPORTS, (
        f"{len(lazy)} function-level imports of internal modules (ceiling {MAX_FUNCTION_LEVEL_IMPORTS}):\n"
        + "\n".join(f"  {w}  {m} -> {', '.join(t)}" for w, m, t in lazy))


def test_lazy_import_allowlist_names_modules(project):
    unknown = [m for m in LAZY_IMPORTS_ALLOWED if not any(arch._in(x, m) for x in project.modules)]
    assert not unknown, f"LAZY_IMPORTS_ALLOWED names no module: {unknown}"


def test_size_limits_cover_every_package():
    """(e) and (f) hold for every package scanned, devices/ included (issue 53): none sits outside."""
    assert set(arch.SIZE_CHECKED) == set(arch.PACKAGES)
    assert "devices" in arch.SIZE_CHECKED


def test_no_long_file(project):
    found = arch.long_files(project, MAX_FILE_LINES)
    assert not found, f"files over {MAX_FILE_LINES} lines: {found}"


def test_no_long_function(project):
    found = arch.long_functions(project, MAX_FUNCTION_LINES, LONG_FUNCTIONS_ALLOWED)
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines (split them, or allowlist with a reason):\n" + "\n".join(
        f"  {n:4d}  {name}  ({w})" for name, w, n in sorted(found, key=lambda f: -f[2]))


def test_long_function_allowlist_is_current(project):
    """Every allowlisted function exists, is still long, and has a reason."""
    lengths = {name: n for name, _, n in arch.functions(project)}
    stale = {k: lengths.get(k) for k in LONG_FUNCTIONS_ALLOWED if lengths.get(k, 0) <= MAX_FUNCTION_LINES}
    assert not stale, f"allowlisted but missing or no longer over {MAX_FUNCTION_LINES} lines: {stale}"
    assert all(isinstance(r, str) and r.strip() for r in LONG_FUNCTIONS_ALLOWED.values())


def test_report_reads_these_thresholds():
    th = arch.load_thresholds(ROOT)
    assert th["MAX_FILE_LINES"] == MAX_FILE_LINES and th["MAX_FUNCTION_LINES"] == MAX_FUNCTION_LINES
    assert th["MAX_FUNCTION_LEVEL_IMPORTS"] == MAX_FUNCTION_LEVEL_IMPORTS
    assert th["LONG_FUNCTIONS_ALLOWED"] == LONG_FUNCTIONS_ALLOWED
    assert th["PACKAGE_EDGES_ALLOWED"] == PACKAGE_EDGES_ALLOWED


# -- the checker itself finds what it must (a synthetic tree, and an injected fault in a copy) ------

def _write(root: Path, files: dict) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_checker_finds_loops_cli_imports_and_lazy_imports(tmp_path):
    _write(tmp_path, {
        "edgeprune/__init__.py": "",
        "edgeprune/a.py": "from . import b\n",
        "edgeprune/b.py": "def f():\n    from edgeprune.c import g\n    return g\n",  # loop via a function
        "edgeprune/c.py": "import edgeprune.a\n",
        "edgeprune/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from edgeprune import e\n",
        "edgeprune/e.py": "from edgeprune.d import x\n",  # TYPE_CHECKING edge only: no loop
        "edgeprune/cli/__init__.py": "from edgeprune import a\n",
        "edgeprune/cli/options.py": "import edgeprune.e\n",
        "edgeprune/cli/face.py": "from edgeprune import errors, prune\nfrom edgeprune.x_settings import S\n",
        "edgeprune/errors.py": "", "edgeprune/x_settings.py": "S = 1\n",
        "edgeprune/api.py": "def f():\n    from edgeprune.cli.options import resolve\n",
        "edgeprune/opt.py": "import onnxruntime\n",
        "edgeprune/uses_opt.py": "def f():\n    from edgeprune import opt\n    import edgeprune.a\n",
        "exporters/__init__.py": "from runners import r\n",
        "runners/r.py": "from exporters import x\n",
        "runners/__init__.py": "",
        "devices/__init__.py": "",
    })
    p = arch.scan(tmp_path)
    loops = arch.import_loops(p)
    assert len(loops) == 2  # a -> b -> c -> a, and exporters <-> runners.r
    assert [comp for comp, _ in loops] == [["edgeprune.a", "edgeprune.b", "edgeprune.c"],
                                           ["exporters", "runners.r"]]
    assert [a for a, _, _ in loops[0][1]] == ["edgeprune.a", "edgeprune.b", "edgeprune.c"]
    assert "edgeprune/b.py:2 (in a function)" in [w for _, _, w in loops[0][1]]
    assert {(i.importer, i.target) for i in arch.cli_imports(p)} == {("edgeprune.api", "edgeprune.cli.options")}
    assert {(i.importer, i.target) for i in arch.cli_library_imports(p)} == {("edgeprune.cli", "edgeprune.a"),
                                                                             ("edgeprune.cli.options", "edgeprune.e")}
    assert len(arch.cross_imports(p, "exporters", "runners")) == 1
    assert len(arch.cross_imports(p, "runners", "exporters")) == 1
    lazy = arch.function_level_imports(p)
    assert [w for w, _, _ in lazy] == ["edgeprune/api.py:2", "edgeprune/b.py:2", "edgeprune/uses_opt.py:3"]
    assert "edgeprune.opt" in arch.optional_dependency_modules(p)
    assert len(arch.function_level_imports(p, {"edgeprune.cli": "", "edgeprune.c": "", "edgeprune.a": ""})) == 0


def test_checker_finds_sizes(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(10))
    _write(tmp_path, {
        "edgeprune/__init__.py": "",
        "edgeprune/m.py": f"class K:\n    def meth(self):\n{body}\n\n\ndef short():\n    pass\n",
        "devices/big.py": "\n" * 50,  # devices/ is size-checked too (issue 53)
        "devices/f.py": "def f():\n" + "    x = 1\n" * 11,
        "exporters/big.py": "x = 1\n" * 12,
    })
    p = arch.scan(tmp_path)
    assert arch.long_functions(p, 10) == [("edgeprune.m.K.meth", "edgeprune/m.py:2", 11),
                                          ("devices.f.f", "devices/f.py:1", 12)]
    assert arch.long_functions(p, 10, {"edgeprune.m.K.meth": "why", "devices.f.f": "why"}) == []
    assert arch.long_files(p, 11) == [("devices/big.py", 50), ("devices/f.py", 12), ("edgeprune/m.py", 16),
                                      ("exporters/big.py", 12)]


def test_injected_loop_and_cli_import_in_a_copy_are_found(tmp_path):
    """A copy of the real packages with one more function-level import of the CLI in a core module:
    the checker reports a new loop through it and a new CLI import."""
    for pkg in arch.PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("*.pyc", "__pycache__", "weights"))
    before = arch.scan(tmp_path)
    victim = tmp_path / "edgeprune" / "errors.py"  # imported by the CLI, which must therefore loop back
    victim.write_text(victim.read_text() + "\n\ndef _injected():\n    from edgeprune.cli import main\n")
    after = arch.scan(tmp_path)
    new_cli = {(i.importer, i.target) for i in arch.cli_imports(after)} - {
        (i.importer, i.target) for i in arch.cli_imports(before)}
    assert new_cli == {("edgeprune.errors", "edgeprune.cli.main")}
    in_loop = lambda p: {m for comp, _ in arch.import_loops(p) for m in comp}  # noqa: E731
    assert "edgeprune.errors" not in in_loop(before) and "edgeprune.errors" in in_loop(after)
    assert len(arch.function_level_imports(after)) == len(arch.function_level_imports(before)) + 1


_LAYERS_DOC = """Some prose, then the order.

```layers
edgeprune edgeprune.api      # the top
edgeprune.feat, edgeprune.feat2
runners.trt
runners exporters
edgeprune.core edgeprune.tc
edgeprune.errors
```
"""


def test_checker_finds_package_loops_and_uphill_imports(tmp_path):
    _write(tmp_path, {
        "docs/architecture.md": _LAYERS_DOC,
        "edgeprune/__init__.py": "from edgeprune import api\n",  # a package's __init__ handing on: no edge
        "edgeprune/api.py": "from edgeprune.core import x\n",
        "edgeprune/core.py": "from edgeprune import errors\n",
        "edgeprune/errors.py": "def f():\n    from edgeprune.api import g\n",  # uphill, closes api-core-errors
        "edgeprune/tc.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from edgeprune import api\n",
        "edgeprune/feat/__init__.py": "from edgeprune.feat.a import y\n",
        "edgeprune/feat/a.py": "from edgeprune.feat2.b import z\n",
        "edgeprune/feat/sub/__init__.py": "from edgeprune.core import x\n",  # part of edgeprune.feat
        "edgeprune/feat2/__init__.py": "",
        "edgeprune/feat2/b.py": "from edgeprune.feat import a\n",  # same layer, but a loop
        "runners/__init__.py": "from runners.trt import backend\n",  # registers a subpackage: no edge
        "runners/base.py": "from edgeprune import errors\n",
        "runners/trt/__init__.py": "",
        "runners/trt/backend.py": "from runners import base\n",
        "exporters/__init__.py": "",
        "devices/__init__.py": "",  # not placed
    })
    p = arch.scan(tmp_path)
    layers = arch.load_layers(tmp_path)
    assert layers[1] == ["edgeprune.feat", "edgeprune.feat2"] and len(layers) == 6
    assert arch.package_of("edgeprune.feat.sub", p) == "edgeprune.feat"
    assert arch.package_of("runners.trt.backend", p) == "runners.trt" and arch.package_of("runners", p) == "runners"
    assert arch.unplaced_packages(p, layers) == ["devices"]
    loops = arch.package_loops(p)
    assert sorted(comp for comp, _ in loops) == [["edgeprune.api", "edgeprune.core", "edgeprune.errors"],
                                                  ["edgeprune.feat", "edgeprune.feat2"]]
    cycle = next(cyc for comp, cyc in loops if "edgeprune.api" in comp)
    assert [(a, b) for a, b, _ in cycle] == [("edgeprune.api", "edgeprune.core"),
                                             ("edgeprune.core", "edgeprune.errors"),
                                             ("edgeprune.errors", "edgeprune.api")]
    assert cycle[2][2] == "edgeprune/errors.py:2  edgeprune.errors -> edgeprune.api (in a function)"
    up = arch.uphill_imports(p, layers)
    assert [(a, b, i.where()) for a, b, i in up] == [("edgeprune.errors", "edgeprune.api", "edgeprune/errors.py:2")]
    # excusing the uphill edge removes it from both checks; the same-layer loop stays
    allowed = {("edgeprune.errors", "edgeprune.api"): "why"}
    assert arch.uphill_imports(p, layers, allowed) == []
    assert [comp for comp, _ in arch.package_loops(p, allowed)] == [["edgeprune.feat", "edgeprune.feat2"]]
    # an allowlist entry is needed while its import exists and is uphill or inside a loop
    allowed.update({("edgeprune.feat2.b", "edgeprune.feat.a"): "loop", ("edgeprune.api", "edgeprune.feat"): "gone",
                    ("runners.base", "edgeprune.errors"): "downhill"})
    assert sorted(arch.stale_allowed_edges(p, layers, allowed)) == [
        (("edgeprune.api", "edgeprune.feat"), "no such import"),
        (("runners.base", "edgeprune.errors"), "neither uphill nor in a package loop")]


def test_layers_block_is_checked(tmp_path):
    _write(tmp_path, {"docs/architecture.md": "no block here\n"})
    with pytest.raises(ValueError, match="no ```layers block"):
        arch.load_layers(tmp_path)
    _write(tmp_path, {"docs/architecture.md": "```layers\na b\nc a\n```\n"})
    with pytest.raises(ValueError, match="a placed twice"):
        arch.load_layers(tmp_path)


def test_injected_uphill_import_in_a_copy_is_found(tmp_path):
    """A copy of the real packages and layer order with one more function-level import of a feature
    package in the model core: the checker reports it uphill, and the package loop it closes."""
    for pkg in arch.PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("*.pyc", "__pycache__", "weights"))
    _write(tmp_path, {str(arch.LAYERS_FILE): (ROOT / arch.LAYERS_FILE).read_text()})
    layers = arch.load_layers(tmp_path)
    before = arch.scan(tmp_path)
    victim = tmp_path / "edgeprune" / "plan.py"  # allocation.rules imports plan: the new edge closes a loop
    victim.write_text(victim.read_text() + "\n\ndef _injected():\n    from edgeprune.allocation import rules\n")
    after = arch.scan(tmp_path)
    edges = lambda p: {(i.importer, i.target) for _, _, i in arch.uphill_imports(p, layers)}  # noqa: E731
    assert edges(after) - edges(before) == {("edgeprune.plan", "edgeprune.allocation.rules")}
    in_loop = lambda p: {m for comp, _ in arch.package_loops(p, PACKAGE_EDGES_ALLOWED) for m in comp}  # noqa: E731
    assert "edgeprune.plan" not in in_loop(before) and {"edgeprune.plan", "edgeprune.allocation"} <= in_loop(after)
