"""Flax models split into ``features`` and ``classifier`` submodules."""

from pflax._src.models import CNN
from pflax._src.models import ConvFeatures
from pflax._src.models import DenseFeatures
from pflax._src.models import feature_dim
from pflax._src.models import get_model
from pflax._src.models import Head
from pflax._src.models import heterogeneous_family
from pflax._src.models import init_stacked
from pflax._src.models import max_pool_2x2
from pflax._src.models import MLP

__all__ = (
    "CNN",
    "ConvFeatures",
    "DenseFeatures",
    "feature_dim",
    "get_model",
    "Head",
    "heterogeneous_family",
    "init_stacked",
    "max_pool_2x2",
    "MLP",
)
