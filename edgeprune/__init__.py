"""edgeprune: make Vision Transformers small and fast for edge devices without retraining.

CORP one-shot structured pruning with closed-form compensation, STARFISH healing, NuWa
class-specific derivation; ONNX export and TensorRT engines. See README.md.

Importing edgeprune applies the torchvision-on-CPU-torch workaround (``edgeprune._compat``) so that
``import timm`` works on CPU-only torch builds.
"""

from edgeprune._compat import import_torchvision as _import_torchvision
from edgeprune._version import __version__

try:
    _import_torchvision()
except ImportError:  # torchvision not installed: timm will say so when it is needed
    pass

from edgeprune.api import PruneResult, prune, structure_summary  # noqa: E402
from edgeprune.artifact import load_run, save_run  # noqa: E402
from edgeprune.corp import CorpConfig  # noqa: E402
from edgeprune.errors import RuntimeFault, UserError  # noqa: E402
from edgeprune.zoo.registry import ModelSpec, get_model_spec  # noqa: E402

__all__ = ["CorpConfig", "PruneResult", "prune", "structure_summary", "load_run", "save_run", "UserError",
           "RuntimeFault", "ModelSpec", "get_model_spec", "__version__"]
