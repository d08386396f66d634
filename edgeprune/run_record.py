"""Validation of a run directory's ``run.json``: a run directory is user input.

Every field that edgeprune reads back from a record (``load_run``, ``spec_from_record``, ``eval``,
``info``, ``export``, ``heal``, ``quantize`` of a run directory) is checked here, once, when the
record is read (:func:`edgeprune.artifact.read_record`), against the one schema of
:mod:`edgeprune.record_schema` (issue 41: every section, the allocation, latency and embed ones
included); a field of the wrong type or value becomes one :class:`~edgeprune.errors.UserError`
line naming the field and the file, never a ``KeyError`` or ``TypeError`` from deep inside a
reader. Fields that are absent from older records keep their defaults (``seed`` 0, no
``weights_sha256``, ...).
"""

from __future__ import annotations

import os
from typing import Any

from edgeprune.record_schema import BLOCK_INT_KEYS, check_record

__all__ = ["validate_record", "BLOCK_INT_KEYS"]


def validate_record(rec: Any, path: str | os.PathLike) -> dict:
    """Check every field edgeprune reads from a run record; return the record.

    Args:
        rec: the parsed ``run.json``.
        path: the file, for the messages.

    Raises:
        UserError: ``"<path>: field 'base_model.name' is missing (...)"`` / ``"... must be <what>,
            got <value> (...)"`` -- one line naming the field and the file; a record that is not a
            JSON object says what the file should be.
    """
    return check_record(rec, path)
