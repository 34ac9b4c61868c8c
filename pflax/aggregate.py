"""Server-side aggregators: pure functions of stacked client pytrees."""

from pflax._src.aggregators.byzantine import bulyan
from pflax._src.aggregators.byzantine import centered_clipping
from pflax._src.aggregators.byzantine import geometric_median
from pflax._src.aggregators.byzantine import krum
from pflax._src.aggregators.byzantine import multi_krum
from pflax._src.aggregators.cwfedavg import class_models
from pflax._src.aggregators.cwfedavg import cw_fedavg
from pflax._src.aggregators.cwfedavg import personalize
from pflax._src.aggregators.fedavg import fedavg
from pflax._src.aggregators.fedclassavg import fedclassavg
from pflax._src.aggregators.feddwa import feddwa
from pflax._src.aggregators.fedrema import FedReMaState
from pflax._src.aggregators.fedrema import fedrema
from pflax._src.aggregators.fedrema import fedrema_init
from pflax._src.aggregators.fedrema import mds
from pflax._src.aggregators.fedrema import probe_logits
from pflax._src.aggregators.fedrema import relevance
from pflax._src.aggregators.fedrema import soft_logits
from pflax._src.aggregators.fedsa import fedsa
from pflax._src.aggregators.robust import capped_weights
from pflax._src.aggregators.robust import clip_updates
from pflax._src.aggregators.robust import log2_update_norms
from pflax._src.aggregators.robust import median
from pflax._src.aggregators.robust import trimmed_mean
from pflax._src.core.weights import estimate_class_dist

__all__ = (
    "FedReMaState",
    "bulyan",
    "capped_weights",
    "centered_clipping",
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
    "geometric_median",
    "krum",
    "log2_update_norms",
    "mds",
    "median",
    "multi_krum",
    "personalize",
    "probe_logits",
    "relevance",
    "soft_logits",
    "trimmed_mean",
)
