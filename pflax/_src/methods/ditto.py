"""Ditto (Li et al., ICML 2021): FedAvg's global model plus proximal personal models."""

from typing import NamedTuple

import chex
import flax.linen as nn
import optax

from pflax._src import methods
from pflax._src.core import types
from pflax._src.core import weights as weights_lib
from pflax._src.methods import algorithm as alg
from pflax._src.methods import common
from pflax._src.methods import fedavg


class DittoModels(NamedTuple):
  """Ditto's state.

  Attributes:
    global_model: the global model `w` (no client axis).
    personal: `(M, ...)` each client's personal model `v_i`.
    num_samples: `(M,)` training-set sizes `n_i`.
  """
  global_model: types.Tree
  personal: types.Stacked
  num_samples: chex.Array


def _held(state: DittoModels) -> types.Stacked:
  """Every client's copy of the global model `w`."""
  return common.broadcast_global(state.global_model, state.num_samples)


def ditto(model: nn.Module, optimizer: optax.GradientTransformation, *,
          lam: float = 0.1, robust: str = "none",
          trim_fraction: float = 0.1, num_byzantine: int = 0,
          radius: float = 1.0) -> alg.Algorithm:
  """Ditto: FedAvg's global model `w` plus personal models `v_i` anchored at it.

  Li, Hu, Beirami and Smith, "Ditto: Fair and Robust Federated Learning Through
  Personalization", ICML 2021. Each participant trains the pair `{"w": w^t,
  "v": v_i}` on the same batches, each model with its own optimizer state:
  `w` with cross-entropy (the global objective), `v` with cross-entropy plus
  `lam/2 ||v - w^t||^2` anchored at the received global model `w^t` (the
  objective of Sec. 3, Algorithm 1). The server averages the trained `w`s (FedAvg, sample-weighted);
  each client keeps its `v`, which is its personalized model.

  Args:
    model: the clients' Flax model.
    optimizer: the optimizer of each of the two models.
    lam: the personal models' proximal weight `lambda` (>= 0; the paper tunes it
      per dataset).
    robust, trim_fraction, num_byzantine, radius: the rule that aggregates
      the global models `w`, as FedAvg's (`pflax.algorithms.fedavg`; "none": the
      sample-weighted mean; docs/robustness.md).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from pflax import algorithms, models
    >>> ditto = algorithms.ditto(models.MLP(10), optax.sgd(0.05), lam=0.5)
    >>> state = algorithms.DittoModels({"a": jnp.ones(3)}, {"a": jnp.ones((2, 3))},
    ...                                jnp.array([1, 2]))
    >>> sorted(ditto.client_models(state)), sorted(ditto.evaluate(state))
    (['v', 'w'], ['global', 'personalized'])

  Notes:
    [settled] `v` takes as many local steps as `w` (Algorithm 1's `s` local
    iterations: here the local epochs), and the global step is FedAvg's
    sample-weighted mean (Algorithm 1 leaves it to the global method); see
    docs/methods.md#ditto.
  """
  alg.check_range("lam", lam, 0.0)
  loss = common.proximal_pair_loss(model, lam)
  aggregate = fedavg.global_aggregator(robust, trim_fraction, None, num_byzantine,
                                       radius)

  def server_update(state, trained, mask, key):
    del key
    return state._replace(
        global_model=aggregate(trained["w"], state.num_samples, mask=mask,
                               reference=state.global_model),
        personal=weights_lib.keep_masked(trained["v"], state.personal, mask))

  return alg.Algorithm(
      init=lambda params, class_counts, key: DittoModels(
          common.first(params), params, common.sample_counts(class_counts)),
      client_models=lambda state: {"w": _held(state), "v": state.personal},
      loss=loss, optimizer=alg.per_model(optimizer, ("w", "v")),
      uploads=alg.model_named("w") if robust == "none" else None,
      server_update=server_update,
      evaluate=lambda state: {"personalized": state.personal,
                              "global": _held(state)},
      client_context=_held)


METHOD = methods.Method(
    name="ditto", builder=ditto,
    paper=('Li et al., "Ditto: Fair and Robust Federated Learning Through '
           'Personalization", ICML 2021'),
    shares_head=False, default=False,
    test=methods.TestSpec(kwargs={"lam": 0.3}, trains="pair"))
