"""The resume record of ``edgeprune deploy``: ``OUT/stages.json`` (issue 42).

Per stage it keeps a hash of the stage's settings, a hash of its input files, the hashes of the
files it wrote (relative to OUT), the seconds it took and a short summary. A stage is reused on a
rerun when its settings and inputs hash as recorded and its outputs are still there, unchanged;
once a stage is redone, every later stage is redone too. The file is written atomically after each
stage (an interrupted deploy resumes at the first unfinished stage) and only when its content
changes (a rerun that redoes nothing leaves it, and every output, untouched).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from edgeprune.atomic import atomic_write_text
from edgeprune.errors import UserError

STATE_FILE = "stages.json"
#: the stages of a deploy, in order
STAGES = ("prune", "heal", "export", "verify", "quantize", "build", "bench")
_CHUNK = 1 << 20


def _file_sha(path: Path, h: Any) -> None:
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)


def hash_paths(paths: list[Any], content: bool = True) -> str:
    """sha256 (hex) of files and folders (None entries and missing paths hash as such).

    ``content``: hash the bytes of every file; else only each file's relative path, size and
    modification time (user data folders: cheap, and a changed file still changes the hash).

    Raises:
        UserError: a path cannot be read.
    """
    h = hashlib.sha256()
    for p in paths:
        h.update(b"\0entry\0")  # the content counts, not where it lies (a moved deploy folder is reused)
        if p is None or not Path(p).exists():
            h.update(f"missing {p}".encode())
            continue
        root = Path(p)
        files = [root] if root.is_file() else sorted(f for f in root.rglob("*") if f.is_file())
        try:
            for f in files:
                st = f.stat()
                rel = f.relative_to(root).as_posix() if f != root else ""
                h.update(f"{rel}\0{st.st_size}\n".encode())
                if content:
                    _file_sha(f, h)
                else:
                    h.update(f"{st.st_mtime_ns}\n".encode())
        except OSError as err:
            raise UserError(f"cannot read {p}: {err.strerror or err}") from None
    return h.hexdigest()


def hash_settings(settings: dict[str, Any]) -> str:
    """sha256 (hex) of a stage's settings (a JSON-able dict; key order does not matter)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


class DeployState:
    """``OUT/stages.json``: ``{"version": 1, "stages": {name: entry}}`` (entries as the module says).

    Raises (on load):
        UserError: the file is not a deploy record (not JSON, not an object).
    """

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.path = self.out / STATE_FILE
        self.stages: dict[str, dict[str, Any]] = {}
        self.redo_rest = False  # a stage was redone: the later ones are redone too
        if self.path.is_file():
            try:
                data = json.loads(self.path.read_text(encoding="utf-8"))
                self.stages = dict(data["stages"])
            except (ValueError, KeyError, TypeError) as err:
                raise UserError(f"{self.path}: not a deploy record ({err}); remove it or choose another -o") from None

    def outputs_hash(self, outputs: list[str]) -> dict[str, str]:
        """``{relative path: sha256}`` of a stage's outputs (under OUT)."""
        return {o: hash_paths([self.out / o]) for o in outputs}

    def reusable(self, name: str, settings: str, inputs: str) -> bool:
        """Whether stage ``name`` ran with these hashes and its outputs are there, unchanged."""
        e = self.stages.get(name)
        if self.redo_rest or not e or e.get("settings") != settings or e.get("inputs") != inputs:
            return False
        outs = e.get("outputs") or {}
        return all((self.out / o).exists() for o in outs) and self.outputs_hash(list(outs)) == outs

    def forget(self, name: str, outputs: list[str] | None = None) -> None:
        """Remove the outputs a previous run of stage ``name`` wrote (before it is redone), and the
        ``outputs`` (relative to OUT) the stage is about to write: an interrupted run of it may
        have left them unfinished and unrecorded (e.g. Ctrl-C after the prune wrote ``run/``
        but before it finished; the stage's command would refuse an existing folder)."""
        self.redo_rest = True
        for o in [*((self.stages.get(name) or {}).get("outputs") or {}), *(outputs or [])]:
            p = self.out / o
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()

    def record(self, name: str, entry: dict[str, Any]) -> None:
        """Set stage ``name``'s entry and write the file atomically (only when it changed)."""
        self.stages[name] = entry
        self.save()

    def save(self) -> None:
        text = json.dumps({"version": 1, "stages": self.stages}, indent=2, sort_keys=True, default=str) + "\n"
        if not self.path.is_file() or self.path.read_text(encoding="utf-8") != text:
            atomic_write_text(self.path, text)


def write_if_changed(path: Path, text: str) -> None:
    """Write ``text`` atomically unless the file already holds it (reruns leave mtimes alone)."""
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        atomic_write_text(path, text)


__all__ = ["DeployState", "STAGES", "STATE_FILE", "hash_paths", "hash_settings", "write_if_changed"]
