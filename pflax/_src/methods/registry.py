"""The built-in methods by command-line name, and what is derived from them.

`METHODS` is the one list of pflax's methods: `pflax-run`, the simulation and
`pflax.algorithms` read it. Adding a method is its file (state, builder,
`METHOD`) and its line here; the order is `pflax-run`'s and the plots' colours.
"""

from collections.abc import Callable
from typing import Any

from pflax._src.methods import Method
from pflax._src.methods import algorithm as alg
from pflax._src.methods import apfl
from pflax._src.methods import cwfedavg
from pflax._src.methods import ditto
from pflax._src.methods import fedala
from pflax._src.methods import fedavg
from pflax._src.methods import fedavg_ft
from pflax._src.methods import fedbabu
from pflax._src.methods import fedclassavg
from pflax._src.methods import feddwa
from pflax._src.methods import fedper
from pflax._src.methods import fedprox
from pflax._src.methods import fedrema
from pflax._src.methods import fedrep
from pflax._src.methods import fedsa
from pflax._src.methods import local
from pflax._src.methods import moon

METHODS: dict[str, Method] = {method.name: method for method in (
    local.METHOD,
    fedavg.METHOD,
    fedprox.METHOD,
    cwfedavg.METHOD,
    fedclassavg.METHOD,
    fedsa.METHOD,
    feddwa.METHOD,
    fedrema.METHOD,
    fedper.METHOD,
    ditto.METHOD,
    fedavg_ft.METHOD,
    fedbabu.METHOD,
    fedrep.METHOD,
    apfl.METHOD,
    moon.METHOD,
    fedala.METHOD,
)}
"""pflax's methods by command-line name, in `pflax-run`'s order."""

BUILDERS: dict[str, Callable[..., alg.Algorithm]] = {
    name: method.builder for name, method in METHODS.items()}
"""The builders of `pflax-run`'s algorithms by command-line name."""

DEFAULT_ALGORITHMS = tuple(name for name, method in METHODS.items() if method.default)
"""What `pflax-run` runs without `--algorithms`: the five papers' methods and the
baselines they share (Local, FedAvg, FedProx); the other baselines on request."""

HEAD_SHARING = tuple(name for name, method in METHODS.items() if method.shares_head)
"""pflax's algorithms whose server step and client context read only the output
layer, so `heterogeneous=True` can wrap them (`pflax.algorithms.heterogeneous`)."""


def default_optimizers() -> dict[str, dict[str, Any]]:
  """The methods' own optimizer overrides, a new dict per call (the default of
  `ExperimentConfig.optimizers`)."""
  return {name: dict(method.optimizer) for name, method in METHODS.items()
          if method.optimizer is not None}
