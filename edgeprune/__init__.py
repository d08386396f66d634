"""edgeprune: make Vision Transformers small and fast for edge devices without retraining.

CORP one-shot structured pruning with closed-form compensation, STARFISH healing, NuWa
class-specific derivation; ONNX export and TensorRT engines. See README.md.

The public names (``prune``, ``load_run``, ``CorpConfig``, ...) are imported on first use
(PEP 562 module ``__getattr__``): ``import edgeprune`` does not import torch, so that the command
line installs its Ctrl-C handling within milliseconds (issue 41). Importing edgeprune installs the
torchvision-on-CPU-torch workaround as an import hook (``edgeprune._compat``), so that
``import timm`` works on CPU-only torch builds.
"""

from __future__ import annotations

import importlib

from edgeprune._compat import install_torchvision_hook as _install_torchvision_hook
from edgeprune._version import __version__

_install_torchvision_hook()

#: public name -> the module that defines it (imported on first access)
_LAZY = {"PruneResult": "edgeprune.api", "prune": "edgeprune.api", "structure_summary": "edgeprune.api",
         "load_run": "edgeprune.artifact", "save_run": "edgeprune.artifact", "CorpConfig": "edgeprune.corp",
         "UserError": "edgeprune.errors", "RuntimeFault": "edgeprune.errors",
         "ModelSpec": "edgeprune.zoo.registry", "get_model_spec": "edgeprune.zoo.registry",
         "deploy": "edgeprune.deploy", "DeployResult": "edgeprune.deploy", "export": "edgeprune.jobs.export",
         "verify": "edgeprune.jobs.verify", "quantize": "edgeprune.jobs.quantize", "build": "edgeprune.jobs.build",
         "bench": "edgeprune.jobs.bench", "prune_run": "edgeprune.jobs.prune_run",
         "heal_run": "edgeprune.jobs.heal_run", "derive_run": "edgeprune.jobs.derive_run",
         "latency_table_run": "edgeprune.jobs.latency_table_run", "PruneSettings": "edgeprune.pruning.settings",
         "eval_run": "edgeprune.jobs.eval_run", "info_run": "edgeprune.jobs.info_run",
         "VerifyFailed": "edgeprune.jobs.verify", "list_profiles": "devices", "load_profile": "devices",
         "is_profile": "devices", "is_main_process": "edgeprune.distributed",
         "network_ref": "edgeprune.zoo.network_file"}


def __getattr__(name: str) -> object:
    """The public names of :data:`_LAZY`, imported on first access (and cached in this module).

    Raises:
        AttributeError: not a public name of edgeprune.
    """
    if name not in _LAZY:
        raise AttributeError(f"module 'edgeprune' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = ["CorpConfig", "PruneResult", "prune", "structure_summary", "load_run", "save_run", "UserError",
           "RuntimeFault", "ModelSpec", "get_model_spec", "deploy", "DeployResult", "export", "verify", "quantize",
           "build", "bench", "prune_run", "heal_run", "derive_run", "latency_table_run", "PruneSettings", "eval_run",
           "info_run", "VerifyFailed", "list_profiles", "load_profile", "is_profile", "is_main_process", "network_ref",
           "__version__"]
