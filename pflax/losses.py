"""Client-side loss terms of the methods (per client, unstacked)."""

from pflax._src.losses import cross_entropy
from pflax._src.losses import proximal
from pflax._src.losses import supcon
from pflax._src.losses import wdr

__all__ = ("cross_entropy", "proximal", "supcon", "wdr")
