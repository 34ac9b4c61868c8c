"""Type aliases shared by pflax modules."""

from collections.abc import Callable
from typing import Any

import chex

Tree = Any
"""A pytree of arrays (one model)."""

Stacked = Any
"""A pytree whose every leaf has a leading client axis of size M."""

Selector = Callable[[tuple[str, ...], chex.Array], bool] | Any
"""A callable `(path, leaf) -> bool` on key-path names, or a pytree of bools."""
