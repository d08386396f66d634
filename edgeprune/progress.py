"""Progress reporting, decided in one place: bars on a terminal, plain log lines elsewhere.

Every long loop of the library goes through :func:`progress`:

* ``enabled=False`` (the CLI's ``--quiet``, or the Python API's default) -- nothing is printed;
* stderr is a terminal -- a tqdm bar (removed when done);
* stderr is a file or a pipe (CI logs, ``2> log.txt``) -- at most a handful of plain lines
  ``<desc>: <done>/<total> <unit>`` (about every 25%) and one line at the end, never the
  carriage-return noise of a bar.

    for x in progress(batches, "calibration", enabled=show, total=len(batches), unit="batch"):
        ...
"""

from __future__ import annotations

import sys
import time
from typing import Any, Iterable, Iterator


def on_terminal() -> bool:
    """True when stderr is an interactive terminal (progress bars make sense there)."""
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError):  # replaced or closed stream
        return False


class LogProgress:
    """A tqdm stand-in that prints plain lines to stderr: start, about every 25%, end.

    Supports the subset of tqdm used in edgeprune: iteration, ``update(n)``,
    ``set_postfix(**values)``, ``write(msg)``, ``close()``.
    """

    def __init__(self, iterable: Iterable | None, desc: str, total: int | None, unit: str) -> None:
        self.iterable = iterable
        self.desc = desc or "progress"
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.total = total
        self.unit = unit
        self.n = 0
        self.postfix = ""
        self._next_report = self._step()
        self._t0 = time.perf_counter()
        self._closed = False

    def _step(self) -> float:
        if not self.total:
            return float("inf")
        return max(1, self.total // 4)

    def _emit(self, final: bool = False) -> None:
        total = f"/{self.total}" if self.total else ""
        tail = f" ({time.perf_counter() - self._t0:.1f} s)" if final else ""
        post = f" {self.postfix}" if self.postfix else ""
        print(f"{self.desc}: {self.n}{total} {self.unit}{post}{tail}", file=sys.stderr, flush=True)

    def update(self, n: int = 1) -> None:
        """Advance by ``n``; prints a line each time another ~25% is done."""
        self.n += n
        if self.n >= self._next_report and (self.total is None or self.n < self.total):
            self._emit()
            self._next_report = self.n + self._step()

    def set_postfix(self, **values: Any) -> None:
        """Values appended to the next line (e.g. the running loss)."""
        self.postfix = " ".join(f"{k}={v}" for k, v in values.items())

    @staticmethod
    def write(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        """Print the final line (once)."""
        if not self._closed:
            self._closed = True
            self._emit(final=True)

    def __iter__(self) -> Iterator:
        assert self.iterable is not None
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()


class _Silent:
    """Progress that prints nothing (``enabled=False``)."""

    def __init__(self, iterable: Iterable | None) -> None:
        self.iterable = iterable

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **values: Any) -> None:
        pass

    @staticmethod
    def write(msg: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __iter__(self) -> Iterator:
        assert self.iterable is not None
        return iter(self.iterable)


def progress(iterable: Iterable | None = None, desc: str = "", *, enabled: bool = True,
             total: int | None = None, unit: str = "it", leave: bool = False) -> Any:
    """Wrap ``iterable`` (or make a manual counter when it is None) in the right progress display.

    Args:
        iterable: what to iterate over, or None for a counter advanced with ``update(n)``.
        desc: label (``"calibration"``, ``"eval"``, ...).
        enabled: False prints nothing at all (``--quiet``).
        total: number of items, for the percentage (default ``len(iterable)`` when it has one).
        unit: item name in the log lines / bar.
        leave: keep the bar on screen when done (terminal only).

    Returns:
        an object that iterates like ``iterable`` and has ``update``, ``set_postfix``, ``write``
        and ``close`` (a tqdm bar on a terminal).
    """
    if not enabled:
        return _Silent(iterable)
    if on_terminal():
        from tqdm.auto import tqdm

        return tqdm(iterable, desc=desc, total=total, unit=unit, leave=leave)
    return LogProgress(iterable, desc, total, unit)
