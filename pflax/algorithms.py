"""Federated algorithms as builders of `Algorithm`s: the eight of `pflax-run`, and the
pieces to write your own (see notebooks/custom_algorithm.ipynb)."""

from pflax._src.algorithm import Algorithm
from pflax._src.algorithm import EVALUATED
from pflax._src.algorithm import Warmup
from pflax._src.algorithm import check_range
from pflax._src.algorithm import cross_entropy_loss
from pflax._src.algorithm import logits
from pflax._src.algorithm import no_context
from pflax._src.algorithm import per_model
from pflax._src.builders import BUILDERS
from pflax._src.builders import CLASSIFIER
from pflax._src.builders import ClassModels
from pflax._src.builders import ClientModels
from pflax._src.builders import ExclusiveModels
from pflax._src.builders import GlobalModel
from pflax._src.builders import MatchedClassifiers
from pflax._src.builders import OUTPUT_LAYER
from pflax._src.builders import SharedHead
from pflax._src.builders import class_wise_averaging
from pflax._src.builders import classifier_averaging
from pflax._src.builders import dynamic_weight_averaging
from pflax._src.builders import federated_averaging
from pflax._src.builders import federated_proximal
from pflax._src.builders import local_training
from pflax._src.builders import parameter_skew_averaging
from pflax._src.builders import relevant_client_matching
from pflax._src.methods.apfl import PersonalMixture
from pflax._src.methods.apfl import adaptive_personalization
from pflax._src.methods.ditto import DittoModels
from pflax._src.methods.ditto import ditto
from pflax._src.methods.fedala import AdaptiveAggregation
from pflax._src.methods.fedala import adaptive_local_aggregation
from pflax._src.methods.fedavg_ft import FineTunedModels
from pflax._src.methods.fedavg_ft import fine_tuned_averaging
from pflax._src.methods.fedbabu import body_aggregation
from pflax._src.methods.fedper import PersonalLayers
from pflax._src.methods.fedper import personalization_layers
from pflax._src.methods.fedrep import SharedRepresentation
from pflax._src.methods.fedrep import representation_sharing
from pflax._src.methods.moon import ContrastiveModels
from pflax._src.methods.moon import model_contrastive
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
    "MatchedClassifiers",
    "OUTPUT_LAYER",
    "PersonalLayers",
    "PersonalMixture",
    "SharedHead",
    "SharedRepresentation",
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
