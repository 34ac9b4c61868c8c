"""One file per method: its state, its builder and its `Method`, listed in `registry`."""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from pflax._src.methods import algorithm as alg


@dataclasses.dataclass(frozen=True, kw_only=True)
class TestSpec:
  """How the generic tests of every method (tests/test_algorithms.py) drive one.

  Attributes:
    kwargs: the builder's keywords in those tests, each away from its default
      so that one wired wrongly shows.
    trains: what a client trains: "model" (its model), "pair" (two models
      `{"w", "v"}` on the same batches) or "ala" (FedALA's `{"weights",
      "delta"}`).
    phased: whether it trains one part, then the other (`phases.two_phases`):
      the output layer, then the rest ("model"); "weights", then "delta" ("ala").
  """
  kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  trains: str = "model"
  phased: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class Method:
  """A built-in method: everything pflax knows of it besides its code.

  Attributes:
    name: its command-line name (`pflax-run --algorithms`, the keys of
      `ExperimentConfig.optimizers` and `hyperparameters`).
    builder: `builder(model, optimizer, **hyperparameters) -> Algorithm`.
    paper: the paper it implements (docs/methods.md has the details).
    shares_head: whether its server step and client context read only the
      output layer, so `heterogeneous=True` can wrap it
      (`pflax.algorithms.heterogeneous`).
    optimizer: its own overrides of the clients' optimizer fields (the default
      of `ExperimentConfig.optimizers`); None: the common optimizer.
    default: whether `pflax-run` runs it without `--algorithms`.
    differentiable: the keywords with a useful hypergradient (`pflax.tune`; "lr"
      is the clients' learning rate, the others the builder's), each checked
      against finite differences in tests/test_tune.py; None: not checked, and
      `pflax.tune` takes "lr" and the builder's float keywords.
    not_differentiable: why each float keyword left out of `differentiable` is
      refused (`pflax.tune.check_keys`).
    test: how the generic tests drive it (`TestSpec`).
  """
  name: str
  builder: Callable[..., alg.Algorithm]
  paper: str
  shares_head: bool
  optimizer: Mapping[str, Any] | None = None
  default: bool
  differentiable: tuple[str, ...] | None = None
  not_differentiable: Mapping[str, str] = dataclasses.field(default_factory=dict)
  test: TestSpec = dataclasses.field(default_factory=TestSpec)
