"""The resume record of ``edgeprune deploy``: ``OUT/stages.json`` (issue 42).

Per stage it keeps a hash of the stage's settings (and the settings themselves, ``values``), a
hash of its input files (and one per input, ``input_hashes``), the hashes of the files it wrote
(relative to OUT), the seconds it took and a short summary. A stage is reused on a rerun when its
settings and inputs hash as recorded and its outputs are still there, unchanged; once a stage is
redone, every later stage is redone too, and a redone stage says why (:meth:`DeployState.stale`:
its settings changed, which input changed, which output is missing or changed, or an earlier
stage was redone). The file is written atomically after each stage (an interrupted deploy resumes
at the first unfinished stage) and only when its content changes (a rerun that redoes nothing
leaves it, and every output, untouched).

The file is user input (copied, edited, damaged): it is checked where it is loaded against
:data:`STATE_SCHEMA` (:mod:`edgeprune.schema`), so that a damaged entry is one line naming the file
and the field, never an ``AttributeError`` later. A deploy folder whose ``stages.json`` was removed
is still recognised by its files (:func:`is_deploy_folder`): the advice of that line ("remove it")
leads to a deploy that redoes every stage.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any, Callable

from edgeprune.atomic import atomic_write_text, is_temporary, temp_prefix
from edgeprune.errors import UserError
from edgeprune.schema import Int, MapOf, Num, Obj, Req, SchemaError, Str, check, shown

STATE_FILE = "stages.json"
#: the stages of a deploy, in order
STAGES = ("prune", "heal", "export", "verify", "quantize", "build", "bench")
_CHUNK = 1 << 20
#: the names a deploy writes in OUT (besides stages.json; its atomic writes' temporaries: atomic.is_temporary)
_DEPLOY_NAME = re.compile(r"run|healed|healed\.partial(\.json)?|verify\.json|quantize\.json|bench\.(json|md)"
                          r"|report\.(md|json|png)|(model|dense|model-(int8|fp16))\.onnx(\.data|\.recipe\.toml)?"
                          r"|model\.engine(\.json)?")


def _hint(path: Path) -> str:
    return (f"the deploy record is damaged or was edited: remove {path} and rerun to redo every stage, "
            "or choose another -o")


def _inside(name: str) -> bool:
    """Whether ``name`` is a path relative to OUT that stays inside it (no absolute path, no ``..``)."""
    p = PurePosixPath(name)
    return bool(name) and "\\" not in name and not p.is_absolute() and ".." not in p.parts


def _entry_ok(d: dict, field: str) -> None:
    for name in d.get("outputs") or {}:
        if not _inside(name):
            raise SchemaError(f"{field}.outputs", f"must name files inside the deploy folder, got {shown(name)}")
    if d["status"] == "done":
        for key in ("settings", "inputs", "outputs"):
            if key not in d:
                raise SchemaError(f"{field}.{key}", "is missing (a finished stage records it)")


def _names_ok(d: dict, field: str) -> None:
    for name in d["stages"]:
        if name not in STAGES:
            raise SchemaError(f"stages.{name}", f"is not a deploy stage (one of {', '.join(STAGES)})")


_HASH = Str(want="a sha256 hex digest")
#: one stage's entry of ``stages.json``
STAGE_SCHEMA = Obj({
    "status": Req(Str(choices=("done", "skipped", "pending"))),
    "settings": _HASH, "inputs": _HASH, "outputs": MapOf(_HASH), "input_hashes": MapOf(_HASH),
    "values": Obj({}), "what": Str(), "why": Str(), "redone": Str(), "command": Str(), "seconds": Num(ge=0),
}, then=_entry_ok)
#: ``stages.json``
STATE_SCHEMA = Obj({"version": Int(min=1, max=1, want="1 (the record version this edgeprune writes)"),
                    "stages": Req(MapOf(STAGE_SCHEMA))}, then=_names_ok)


def is_deploy_folder(out: Path) -> bool:
    """Whether ``out`` (a folder without ``stages.json``) is an earlier deploy's by its files: it holds
    the prune's ``run/run.json`` and nothing but names a deploy writes."""
    try:
        names = os.listdir(out)
    except OSError:
        return False
    return (out / "run" / "run.json").is_file() and all(_DEPLOY_NAME.fullmatch(n) or is_temporary(n) for n in names)


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


def setting_values(settings: dict[str, Any]) -> dict[str, Any]:
    """A stage's settings as ``stages.json`` keeps them (JSON values; what :func:`hash_settings` hashes)."""
    return json.loads(json.dumps(settings, sort_keys=True, default=str))


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}".replace("_", "-")
        if isinstance(v, dict) and v:
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def _value(v: Any) -> str:
    return "none" if v is None else json.dumps(v) if isinstance(v, (dict, list, bool)) else str(v)


def settings_change(before: dict[str, Any] | None, now: dict[str, Any] | None) -> str:
    """``"settings changed: sparsity 0.3 -> 0.5"`` (the first three changed keys), or without the list
    where the record does not keep the earlier values (a record older than ``values``)."""
    if not isinstance(before, dict) or now is None:
        return "settings changed"
    a, b = _flat(before), _flat(setting_values(now))
    changed = [f"{k} {_value(a.get(k))} -> {_value(b.get(k))}" for k in sorted({*a, *b}) if a.get(k) != b.get(k)]
    if not changed:
        return "settings changed"
    more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
    return "settings changed: " + ", ".join(changed[:3]) + more


class DeployState:
    """``OUT/stages.json``: ``{"version": 1, "stages": {name: entry}}`` (entries as the module says).

    Raises (on load):
        UserError: the file is not a deploy record (not JSON, not an object, an entry that does not
            fit :data:`STATE_SCHEMA`): one line naming the file and the field.
    """

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.path = self.out / STATE_FILE
        self.stages: dict[str, dict[str, Any]] = {}
        self.redone: list[str] = []  # the stages this run redid, in order: every later one is redone too
        if self.path.is_file():
            try:
                data = json.loads(self.path.read_text(encoding="utf-8"))
            except (ValueError, OSError) as err:
                raise UserError(f"{self.path}: not a deploy record ({err}) ({_hint(self.path)})") from None
            if not isinstance(data, dict):
                raise UserError(f"{self.path}: not a deploy record: it should be the JSON object edgeprune deploy "
                                f"writes, got {shown(data)} ({_hint(self.path)})")
            self.stages = dict(check(STATE_SCHEMA, data, str(self.path), _hint(self.path))["stages"])

    @property
    def redo_rest(self) -> bool:
        """Whether a stage was redone in this run (then the later ones are redone too)."""
        return bool(self.redone)

    def outputs_hash(self, outputs: list[str]) -> dict[str, str]:
        """``{relative path: sha256}`` of a stage's outputs (under OUT)."""
        return {o: hash_paths([self.out / o]) for o in outputs}

    def stale(self, name: str, settings: str, inputs: str, values: dict[str, Any] | None = None,
              input_hashes: Callable[[], dict[str, str]] | dict[str, str] | None = None) -> str | None:
        """Why stage ``name`` cannot be reused (one phrase), or None when it can: it ran with these
        settings and inputs hashes, no earlier stage was redone in this run, and its outputs are there,
        unchanged.

        ``values`` (the settings) and ``input_hashes`` (``{label: hash}`` per input, or a function
        giving it: called only when the inputs changed) only name what changed.
        """
        e = self.stages.get(name)
        if not e or e.get("status") != "done":
            return "not run before"
        if e.get("settings") != settings:
            return settings_change(e.get("values"), values)
        if e.get("inputs") != inputs:
            before = e.get("input_hashes") or {}
            now = (input_hashes() if callable(input_hashes) else input_hashes) or {}
            changed = [k for k, h in now.items() if k in before and before[k] != h]
            return "input changed" + (": " + ", ".join(changed) if changed else "")
        if self.redone:
            return f"an earlier stage was redone ({self.redone[0]})"
        outs = e.get("outputs") or {}
        missing = [o for o in outs if not (self.out / o).exists()]
        if missing:
            return "output missing: " + ", ".join(missing)
        now = self.outputs_hash(list(outs))
        changed = [o for o in outs if now[o] != outs[o]]
        if changed:
            return "output changed or damaged: " + ", ".join(changed)
        return None

    def reusable(self, name: str, settings: str, inputs: str) -> bool:
        """Whether stage ``name`` ran with these hashes and its outputs are there, unchanged (and no
        earlier stage was redone in this run)."""
        return self.stale(name, settings, inputs) is None

    def _doomed(self, name: str, outputs: list[str] | None) -> list[Path]:
        names = [*((self.stages.get(name) or {}).get("outputs") or {}), *(outputs or [])]
        return [self.out / o for o in dict.fromkeys(names) if _inside(o) and (self.out / o).exists()]

    def forget(self, name: str, outputs: list[str] | None = None) -> None:
        """Remove the outputs a previous run of stage ``name`` wrote (before it is redone), and the
        ``outputs`` (relative to OUT) the stage is about to write: an interrupted run of it may
        have left them unfinished and unrecorded (e.g. Ctrl-C after the prune wrote ``run/``
        but before it finished; the stage's command would refuse an existing folder). Every later
        stage is redone from now on."""
        self.redone.append(name)
        for p in self._doomed(name, outputs):
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()

    def set_aside(self, name: str, outputs: list[str] | None = None) -> "Aside":
        """Like :meth:`forget`, but the files are moved into a temporary folder in OUT; the returned
        :class:`Aside` puts them back (:meth:`Aside.restore`, a refused stage) or removes them."""
        self.redone.append(name)
        return Aside(self, name, self._doomed(name, outputs), outputs or [])

    def record(self, name: str, entry: dict[str, Any]) -> None:
        """Set stage ``name``'s entry and write the file atomically (only when it changed)."""
        self.stages[name] = entry
        self.save()

    def save(self) -> None:
        """Write ``stages.json`` atomically, unless it already holds this content."""
        text = json.dumps({"version": 1, "stages": self.stages}, indent=2, sort_keys=True, default=str) + "\n"
        if not self.path.is_file() or self.path.read_text(encoding="utf-8") != text:
            atomic_write_text(self.path, text)


class Aside:
    """The earlier outputs of a stage about to be redone, moved into a temporary folder of OUT (named
    like the atomic writes' temporaries: a killed deploy's is removed by the next write there)."""

    def __init__(self, state: DeployState, name: str, paths: list[Path], outputs: list[str]) -> None:
        self.state, self.name, self.moved = state, name, []
        self.outputs = [state.out / o for o in outputs]
        self.folder = Path(tempfile.mkdtemp(prefix=temp_prefix(state.out / f"{name}-before"), suffix=".tmp",
                                            dir=state.out)) if paths else None
        for i, p in enumerate(paths):
            kept = self.folder / f"{i}-{p.name}"  # type: ignore[operator]
            os.rename(p, kept)
            self.moved.append((p, kept))

    def restore(self) -> bool:
        """Put the files back when the stage wrote none of its outputs (it refused before writing) and
        it is the first stage this run redid: the folder is then the earlier deploy's, as it was.
        Returns whether they were put back."""
        if self.state.redone != [self.name] or any(p.exists() for p in [*self.outputs, *(p for p, _ in self.moved)]):
            return False
        for p, kept in self.moved:
            os.rename(kept, p)
        self.moved = []
        self.state.redone.remove(self.name)
        return True

    def drop(self) -> None:
        """Remove what is still set aside (the stage was redone, or failed after writing)."""
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder, self.moved = None, []


def write_if_changed(path: Path, text: str) -> None:
    """Write ``text`` atomically unless the file already holds it (reruns leave mtimes alone)."""
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        atomic_write_text(path, text)


__all__ = ["Aside", "DeployState", "STAGES", "STAGE_SCHEMA", "STATE_FILE", "STATE_SCHEMA", "hash_paths",
           "hash_settings", "is_deploy_folder", "setting_values", "settings_change", "write_if_changed"]
