"""Architecture rules of the project, checked on the source (pure ``ast``; issue 28).

(a) no import loop among the modules of edgeprune/, exporters/, runners/, devices/ (function-level
    imports included); (b) nothing outside ``edgeprune.cli`` imports it; (c) exporters and runners
    depend one way; (d) function-level imports of internal modules only for optional dependencies
    (count printed, ceiling below); (e) no file in edgeprune/, exporters/, runners/ over
    MAX_FILE_LINES lines; (f) no function over MAX_FUNCTION_LINES lines except the allowlist.

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
# -----------------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("architecture_report", ROOT / "tools" / "architecture_report.py")
arch = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("architecture_report", arch)
_spec.loader.exec_module(arch)


@pytest.fixture(scope="module")
def project():
    return arch.scan(ROOT)


def test_no_import_loop(project):
    loops = arch.import_loops(project)
    assert not loops, f"{len(loops)} import loop(s):\n{arch.format_loops(loops)}"


def test_no_core_module_imports_the_cli(project):
    found = arch.cli_imports(project)
    assert not found, "library code imports edgeprune.cli:\n" + "\n".join(
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
        "devices/big.py": "\n" * 50,  # devices/ is not size-checked
        "exporters/big.py": "x = 1\n" * 12,
    })
    p = arch.scan(tmp_path)
    assert arch.long_functions(p, 10) == [("edgeprune.m.K.meth", "edgeprune/m.py:2", 11)]
    assert arch.long_functions(p, 10, {"edgeprune.m.K.meth": "why"}) == []
    assert arch.long_files(p, 11) == [("edgeprune/m.py", 16), ("exporters/big.py", 12)]


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
