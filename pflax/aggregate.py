"""Server-side aggregators: pure functions of stacked client pytrees."""

from pflax._src.cwfedavg import class_models
from pflax._src.cwfedavg import cw_fedavg
from pflax._src.cwfedavg import personalize
from pflax._src.fedavg import fedavg
from pflax._src.fedavg import fedclassavg
from pflax._src.feddwa import feddwa
from pflax._src.fedrema import FedReMaState
from pflax._src.fedrema import fedrema
from pflax._src.fedrema import fedrema_init
from pflax._src.fedrema import mds
from pflax._src.fedrema import probe_logits
from pflax._src.fedrema import relevance
from pflax._src.fedrema import soft_logits
from pflax._src.fedsa import fedsa
from pflax._src.robust import capped_weights
from pflax._src.robust import clip_updates
from pflax._src.robust import log2_update_norms
from pflax._src.robust import median
from pflax._src.robust import trimmed_mean
from pflax._src.weights import estimate_class_dist

__all__ = (
    "FedReMaState",
    "capped_weights",
    "class_models",
    "clip_updates",
    "cw_fedavg",
    "estimate_class_dist",
    "fedavg",
    "fedclassavg",
    "feddwa",
    "fedrema",
    "fedrema_init",
    "fedsa",
    "log2_update_norms",
    "mds",
    "median",
    "personalize",
    "probe_logits",
    "relevance",
    "soft_logits",
    "trimmed_mean",
)
