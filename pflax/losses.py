"""Client-side loss terms of the methods (per client, unstacked)."""

from pflax._src.training.losses import cross_entropy
from pflax._src.training.losses import proximal
from pflax._src.training.losses import supcon
from pflax._src.training.losses import wdr

__all__ = ("cross_entropy", "proximal", "supcon", "wdr")
