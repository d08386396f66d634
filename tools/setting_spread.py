"""How far a declared setting travels (issue 53: "no setting's name appears in more than 3 library files outside its
own section's package"), from the source alone (pure ``ast``, nothing imported).

    python tools/setting_spread.py [--all]

*Settings*: the fields of the classes under ``edgeprune/`` declared with ``setting(...)``
(``edgeprune.settings.setting``); a setting's *home* is the package of the module that declares it (``edgeprune/corp/``
for ``edgeprune/corp/settings.py``; the file itself for a top-level module).

*A library file names a setting* when it reads an attribute of that name (``cfg.correction_rounds``) or holds the
name as a whole string (``"correction_rounds"``: a record key, a ``getattr``, a keyword map). Function parameters and
keywords of the same name are the code's own vocabulary, not a trip of the setting, and are not counted; nor are
files of the setting's home, of ``edgeprune/cli/`` (the command line is a view of the declarations) or outside
``edgeprune/``.

Only names with an underscore are measured: a one-word name (``n``, ``dims``, ``latency``, ``tokens``) is also the
name of unrelated attributes everywhere, and counting it would measure the English language, not the setting. The
report prints how many one-word settings were left out.

``tests/test_architecture.py`` holds the ceiling (``MAX_SETTING_FILES``) and the settings still above it with the
number of files each may have (``SETTING_SPREAD_ALLOWED``: it may shrink, never grow; an entry no longer needed
fails the test).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = "edgeprune"
CLI_DIR = Path("edgeprune") / "cli"


@dataclass(frozen=True)
class Declared:
    """One declared setting: its field name, its section class, the file that declares it and its home."""

    name: str
    section: str
    path: str  # relative to the root
    home: str  # a folder (``edgeprune/corp``) or, for a top-level module, that file


def _home(rel: Path) -> str:
    return str(rel) if rel.parent == Path(LIBRARY) else str(Path(*rel.parts[:2]))


def _is_setting_call(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Name) and node.func.id == "setting")
        or (isinstance(node.func, ast.Attribute) and node.func.attr == "setting"))


def declared_settings(root: Path | str = ROOT) -> list[Declared]:
    """Every ``name: T = setting(...)`` field of a class under ``edgeprune/``."""
    root = Path(root)
    out = []
    for path in sorted((root / LIBRARY).rglob("*.py")):
        rel = path.relative_to(root)
        for node in ast.walk(ast.parse(path.read_text(), str(rel))):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) \
                            and _is_setting_call(item.value):
                        out.append(Declared(item.target.id, node.name, str(rel), _home(rel)))
    return out


def named_in(root: Path | str = ROOT) -> dict[str, set[str]]:
    """``{library file: the attribute names it reads and the whole strings it holds}`` (cli/ left out)."""
    root = Path(root)
    out = {}
    for path in sorted((root / LIBRARY).rglob("*.py")):
        rel = path.relative_to(root)
        if CLI_DIR in rel.parents:
            continue
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(rel))):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                names.add(node.value)
        out[str(rel)] = names
    return out


def spread(root: Path | str = ROOT) -> dict[str, list[str]]:
    """``{setting name: the library files outside its home(s) that name it}`` for the measured (multi-word)
    settings. A name declared by several sections (``precision`` of bench and build) counts the files outside all
    of its homes."""
    homes: dict[str, set[str]] = {}
    for d in declared_settings(root):
        if "_" in d.name.strip("_"):
            homes.setdefault(d.name, set()).add(d.home)
    files = named_in(root)
    out = {}
    for name, hs in sorted(homes.items()):
        out[name] = sorted(f for f, names in files.items() if name in names
                           and not any(f == h or f.startswith(h + "/") for h in hs))
    return out


def one_word_settings(root: Path | str = ROOT) -> list[str]:
    """The declared settings left unmeasured (a one-word name: module doc)."""
    return sorted({d.name for d in declared_settings(root) if "_" not in d.name.strip("_")})


def over(found: dict[str, list[str]], ceiling: int) -> dict[str, int]:
    """``{setting: number of files}`` of the settings named in more than ``ceiling`` files outside their home."""
    return {name: len(fs) for name, fs in found.items() if len(fs) > ceiling}


def main(argv: list[str]) -> int:
    found = spread(ROOT)
    ceiling = 3
    above = over(found, ceiling)
    print(f"settings measured (multi-word names): {len(found)}; named in more than {ceiling} library files outside "
          f"their home: {len(above)}; one-word settings not measured: {len(one_word_settings(ROOT))}")
    for name, fs in sorted(found.items(), key=lambda kv: -len(kv[1])):
        if len(fs) > ceiling or "--all" in argv:
            print(f"  {len(fs):3d}  {name}: {' '.join(f.removeprefix('edgeprune/') for f in fs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
