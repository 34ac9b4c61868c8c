"""The eight federated algorithms as `(init, client_update, server_update)` bundles."""

from pflax._src.algorithms import NAMES
from pflax._src.algorithms import Algorithm
from pflax._src.algorithms import Federation
from pflax._src.algorithms import Hyperparameters
from pflax._src.algorithms import augment
from pflax._src.algorithms import client_inputs
from pflax._src.algorithms import client_outputs
from pflax._src.algorithms import client_update
from pflax._src.algorithms import cwfedavg
from pflax._src.algorithms import fedavg
from pflax._src.algorithms import fedclassavg
from pflax._src.algorithms import fedclassavg_joint_update
from pflax._src.algorithms import feddwa
from pflax._src.algorithms import fedprox
from pflax._src.algorithms import fedrema
from pflax._src.algorithms import fedsa
from pflax._src.algorithms import get_algorithm
from pflax._src.algorithms import init_opt_state
from pflax._src.algorithms import local

__all__ = (
    "NAMES",
    "Algorithm",
    "Federation",
    "Hyperparameters",
    "augment",
    "client_inputs",
    "client_outputs",
    "client_update",
    "cwfedavg",
    "fedavg",
    "fedclassavg",
    "fedclassavg_joint_update",
    "feddwa",
    "fedprox",
    "fedrema",
    "fedsa",
    "get_algorithm",
    "init_opt_state",
    "local",
)
