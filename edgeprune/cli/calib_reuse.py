"""The calibration folder a run recorded (issue 42): :mod:`edgeprune.jobs.calib_reuse`, handed on."""

from edgeprune.jobs.calib_reuse import (calibration_fields, folder_sha256, heldout_source,  # noqa: F401
                                        recorded_eval_folder, recorded_folder)

__all__ = ["calibration_fields", "folder_sha256", "heldout_source", "recorded_eval_folder", "recorded_folder"]
