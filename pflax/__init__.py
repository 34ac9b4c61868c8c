"""pflax: functional JAX aggregation primitives for personalized federated learning."""

from pflax import aggregate
from pflax import algorithms
from pflax import data
from pflax import losses
from pflax import models
from pflax import simulate
from pflax import train
from pflax import tree
from pflax import tune

__version__ = "0.1.0"

__all__ = ("aggregate", "algorithms", "data", "losses", "models", "simulate", "train",
           "tree", "tune")
