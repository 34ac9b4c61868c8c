"""Federated algorithms as builders of `Algorithm`s: the methods of `pflax-run`
(`METHODS`), and the pieces to write your own (see notebooks/custom_algorithm.ipynb)."""

from pflax._src.methods import Method
from pflax._src.methods.algorithm import Algorithm
from pflax._src.methods.algorithm import Architectures
from pflax._src.methods.algorithm import EVALUATED
from pflax._src.methods.algorithm import Warmup
from pflax._src.methods.algorithm import check_range
from pflax._src.methods.algorithm import cross_entropy_loss
from pflax._src.methods.algorithm import logits
from pflax._src.methods.algorithm import no_context
from pflax._src.methods.algorithm import per_model
from pflax._src.methods.apfl import PersonalMixture
from pflax._src.methods.apfl import apfl
from pflax._src.methods.common import CLASSIFIER
from pflax._src.methods.common import OUTPUT_LAYER
from pflax._src.methods.cwfedavg import ClassModels
from pflax._src.methods.cwfedavg import cwfedavg
from pflax._src.methods.ditto import DittoModels
from pflax._src.methods.ditto import ditto
from pflax._src.methods.fedala import AdaptiveAggregation
from pflax._src.methods.fedala import fedala
from pflax._src.methods.fedavg import GlobalModel
from pflax._src.methods.fedavg import fedavg
from pflax._src.methods.fedavg_ft import FineTunedModels
from pflax._src.methods.fedavg_ft import fedavg_ft
from pflax._src.methods.fedbabu import fedbabu
from pflax._src.methods.fedclassavg import SharedHead
from pflax._src.methods.fedclassavg import fedclassavg
from pflax._src.methods.feddwa import ExclusiveModels
from pflax._src.methods.feddwa import feddwa
from pflax._src.methods.fedper import PersonalLayers
from pflax._src.methods.fedper import fedper
from pflax._src.methods.fedprox import fedprox
from pflax._src.methods.fedrema import MatchedClassifiers
from pflax._src.methods.fedrema import fedrema
from pflax._src.methods.fedrep import fedrep
from pflax._src.methods.fedsa import fedsa
from pflax._src.methods.heterogeneous import HeterogeneousState
from pflax._src.methods.heterogeneous import heterogeneous
from pflax._src.methods.local import ClientModels
from pflax._src.methods.local import local
from pflax._src.methods.moon import ContrastiveModels
from pflax._src.methods.moon import moon
from pflax._src.methods.registry import METHODS

__all__ = (
    "AdaptiveAggregation",
    "Algorithm",
    "Architectures",
    "CLASSIFIER",
    "ClassModels",
    "ClientModels",
    "ContrastiveModels",
    "DittoModels",
    "EVALUATED",
    "ExclusiveModels",
    "FineTunedModels",
    "GlobalModel",
    "HeterogeneousState",
    "METHODS",
    "MatchedClassifiers",
    "Method",
    "OUTPUT_LAYER",
    "PersonalLayers",
    "PersonalMixture",
    "SharedHead",
    "Warmup",
    "apfl",
    "check_range",
    "cross_entropy_loss",
    "cwfedavg",
    "ditto",
    "fedala",
    "fedavg",
    "fedavg_ft",
    "fedbabu",
    "fedclassavg",
    "feddwa",
    "fedper",
    "fedprox",
    "fedrema",
    "fedrep",
    "fedsa",
    "heterogeneous",
    "local",
    "logits",
    "moon",
    "no_context",
    "per_model",
)
