"""The one-shot prune in one place (issue 39): its settings by section (:mod:`.settings`), its config
(:mod:`.config`), the stages and their order (:mod:`.stage`, :mod:`.stages`: embed first -> CORP -> embed last ->
class-token block -> output correction), the CORP stage (:mod:`.corp`), the output correction (:mod:`.output`), the
record (:mod:`.record`), the driver (:mod:`.run`, :mod:`.dispatch`), the ``embed_sparsity="auto"`` search
(:mod:`.embed_auto`) and the measured latency check after a ``--latency`` prune (:mod:`.latency_check`).
``edgeprune.api`` is the public face.

(Named ``pruning``, not ``prune``: a subpackage ``edgeprune.prune`` would shadow the function ``edgeprune.prune``.)
"""

from edgeprune.pruning.config import check_config, corp_config
from edgeprune.pruning.settings import SECTIONS
from edgeprune.pruning.dispatch import prune_model
from edgeprune.pruning.stage import PruneState, Stage, register_stage, stage_names, unregister_stage

__all__ = ["SECTIONS", "PruneState", "Stage", "check_config", "corp_config", "prune_model", "register_stage",
           "stage_names", "unregister_stage"]
