"""The built-in methods by command-line name, and what is derived from them.

`METHODS` is the one list of pflax's methods: `pflax-run`, the simulation and
`pflax.algorithms` read it. Adding a method is its file (state, builder,
`METHOD`), its name's line in `NAMES` and its reference in
tests/test_algorithms.py; the order is `pflax-run`'s and the
plots' colours.
"""

import importlib
from typing import Any

from pflax._src.methods import Method

NAMES = (
    "local",
    "fedavg",
    "fedprox",
    "cwfedavg",
    "fedclassavg",
    "fedsa",
    "feddwa",
    "fedrema",
    "fedper",
    "ditto",
    "fedavg_ft",
    "fedbabu",
    "fedrep",
    "apfl",
    "moon",
    "fedala",
)
"""The methods' command-line names: each is the file `pflax/_src/methods/<name>.py`,
which ends with its `METHOD`."""

METHODS: dict[str, Method] = {
    name: importlib.import_module(f"pflax._src.methods.{name}").METHOD for name in NAMES}
"""pflax's methods by command-line name, in `pflax-run`'s order."""

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
