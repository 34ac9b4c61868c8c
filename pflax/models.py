"""pflax's Flax models (``features`` and ``classifier`` submodules), `as_model`
(any JAX model: Flax linen or NNX, Equinox, a pair of functions) and `Parts`:
which layers of a model pflax's methods read."""

from pflax._src.training.adapters import ACCEPTED
from pflax._src.training.adapters import as_model
from pflax._src.training.models import CNN
from pflax._src.training.models import ConvFeatures
from pflax._src.training.models import DenseFeatures
from pflax._src.training.models import FAMILIES
from pflax._src.training.models import Head
from pflax._src.training.models import MLP
from pflax._src.training.models import feature_dim
from pflax._src.training.models import get_model
from pflax._src.training.models import heterogeneous_family
from pflax._src.training.models import init_stacked
from pflax._src.training.models import max_pool_2x2
from pflax._src.training.models import mlp_family
from pflax._src.training.parts import Parts
from pflax._src.training.parts import model_parts
from pflax._src.training.parts import output_kernel

__all__ = (
    "ACCEPTED",
    "CNN",
    "ConvFeatures",
    "DenseFeatures",
    "FAMILIES",
    "Head",
    "MLP",
    "Parts",
    "as_model",
    "feature_dim",
    "get_model",
    "heterogeneous_family",
    "init_stacked",
    "max_pool_2x2",
    "mlp_family",
    "model_parts",
    "output_kernel",
)
