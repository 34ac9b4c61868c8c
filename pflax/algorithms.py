"""Federated algorithms as builders of `Algorithm`s: the methods of `pflax-run`
(`METHODS`), and the pieces to write your own (see notebooks/custom_algorithm.ipynb)."""

from pflax._src.algorithm import Algorithm
from pflax._src.algorithm import EVALUATED
from pflax._src.algorithm import Warmup
from pflax._src.algorithm import check_range
from pflax._src.algorithm import cross_entropy_loss
from pflax._src.algorithm import logits
from pflax._src.algorithm import no_context
from pflax._src.algorithm import per_model
from pflax._src.methods import Method
from pflax._src.methods.apfl import PersonalMixture
from pflax._src.methods.apfl import adaptive_personalization
from pflax._src.methods.common import CLASSIFIER
from pflax._src.methods.common import OUTPUT_LAYER
from pflax._src.methods.cwfedavg import ClassModels
from pflax._src.methods.cwfedavg import class_wise_averaging
from pflax._src.methods.ditto import DittoModels
from pflax._src.methods.ditto import ditto
from pflax._src.methods.fedala import AdaptiveAggregation
from pflax._src.methods.fedala import adaptive_local_aggregation
from pflax._src.methods.fedavg import GlobalModel
from pflax._src.methods.fedavg import federated_averaging
from pflax._src.methods.fedavg_ft import FineTunedModels
from pflax._src.methods.fedavg_ft import fine_tuned_averaging
from pflax._src.methods.fedbabu import body_aggregation
from pflax._src.methods.fedclassavg import SharedHead
from pflax._src.methods.fedclassavg import classifier_averaging
from pflax._src.methods.feddwa import ExclusiveModels
from pflax._src.methods.feddwa import dynamic_weight_averaging
from pflax._src.methods.fedper import PersonalLayers
from pflax._src.methods.fedper import personalization_layers
from pflax._src.methods.fedprox import federated_proximal
from pflax._src.methods.fedrema import MatchedClassifiers
from pflax._src.methods.fedrema import relevant_client_matching
from pflax._src.methods.fedrep import representation_sharing
from pflax._src.methods.fedsa import parameter_skew_averaging
from pflax._src.methods.local import ClientModels
from pflax._src.methods.local import local_training
from pflax._src.methods.moon import ContrastiveModels
from pflax._src.methods.moon import model_contrastive
from pflax._src.methods.registry import BUILDERS
from pflax._src.methods.registry import METHODS
from pflax._src.groups import Heterogeneous
from pflax._src.groups import HeterogeneousState
from pflax._src.groups import heterogeneous

__all__ = (
    "AdaptiveAggregation",
    "Algorithm",
    "BUILDERS",
    "CLASSIFIER",
    "ClassModels",
    "ClientModels",
    "ContrastiveModels",
    "DittoModels",
    "EVALUATED",
    "ExclusiveModels",
    "FineTunedModels",
    "GlobalModel",
    "Heterogeneous",
    "HeterogeneousState",
    "METHODS",
    "MatchedClassifiers",
    "Method",
    "OUTPUT_LAYER",
    "PersonalLayers",
    "PersonalMixture",
    "SharedHead",
    "Warmup",
    "adaptive_local_aggregation",
    "adaptive_personalization",
    "body_aggregation",
    "check_range",
    "class_wise_averaging",
    "classifier_averaging",
    "cross_entropy_loss",
    "ditto",
    "dynamic_weight_averaging",
    "federated_averaging",
    "federated_proximal",
    "fine_tuned_averaging",
    "heterogeneous",
    "local_training",
    "logits",
    "model_contrastive",
    "no_context",
    "parameter_skew_averaging",
    "per_model",
    "personalization_layers",
    "relevant_client_matching",
    "representation_sharing",
)
