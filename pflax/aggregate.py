"""Server-side aggregators: pure functions of stacked client pytrees."""

from pflax._src.cwfedavg import class_models
from pflax._src.cwfedavg import cw_fedavg
from pflax._src.cwfedavg import estimate_class_dist
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

__all__ = (
    "FedReMaState",
    "class_models",
    "cw_fedavg",
    "estimate_class_dist",
    "fedavg",
    "fedclassavg",
    "feddwa",
    "fedrema",
    "fedrema_init",
    "fedsa",
    "mds",
    "personalize",
    "probe_logits",
    "relevance",
    "soft_logits",
)
