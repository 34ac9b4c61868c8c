"""Stacked-pytree plumbing: leaves with a leading client axis M."""

from pflax._src.core.tree import broadcast
from pflax._src.core.tree import combine
from pflax._src.core.tree import concat
from pflax._src.core.tree import cosine_similarity
from pflax._src.core.tree import finite_clients
from pflax._src.core.tree import mix
from pflax._src.core.tree import num_clients
from pflax._src.core.tree import partition
from pflax._src.core.tree import selected
from pflax._src.core.tree import stack
from pflax._src.core.tree import under
from pflax._src.core.tree import unstack
from pflax._src.core.tree import weighted_mean
from pflax._src.core.tree import with_selected

__all__ = (
    "broadcast",
    "combine",
    "concat",
    "cosine_similarity",
    "finite_clients",
    "mix",
    "num_clients",
    "partition",
    "selected",
    "stack",
    "under",
    "unstack",
    "weighted_mean",
    "with_selected",
)
