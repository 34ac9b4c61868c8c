"""pflax: functional JAX aggregation primitives for personalized federated learning."""

from pflax import aggregate
from pflax import losses
from pflax import tree

__version__ = "0.1.0"

__all__ = ("aggregate", "losses", "tree")
