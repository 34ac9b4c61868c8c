"""Two personalized FL methods written with pflax's public API only.

Run them like pflax's own algorithms, from this directory:

  pflax-run --algorithms my_algorithms:fedper my_algorithms:ditto fedavg
  pflax-run --algorithms my_algorithms:ditto --sweep lam --values 0.01 0.1 1 --seeds 0 1

or from Python with `pflax.simulate.run(fedper, config, seed)`; see
custom_algorithm.ipynb for a walk-through. pflax ships both as well
(`pflax-run --algorithms fedper ditto`, `pflax.algorithms.fedper`
and `pflax.algorithms.ditto`): these are the one-page versions of the walk-through.
"""

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import optax

from pflax import aggregate
from pflax import algorithms
from pflax import losses
from pflax import tree


class FedPerState(NamedTuple):
  """Each client's model (its personalization layers are its own) and `n_i`."""
  params: Any
  num_samples: Any


def fedper(model: nn.Module, optimizer: optax.GradientTransformation, *,
           personal: Any = algorithms.CLASSIFIER) -> algorithms.Algorithm:
  """FedPer (Arivazhagan et al., 2019): base layers averaged, personal layers local.

  Args:
    model: the clients' Flax model.
    optimizer: the clients' optimizer.
    personal: selector of the personalization layers (default: the classifier).
  """
  def server_update(state, trained, mask, key):
    del key
    own, base = tree.partition(trained, personal)
    base = aggregate.fedavg(base, state.num_samples, mask=mask)
    base = tree.broadcast(base, tree.num_clients(trained))
    return state._replace(params=tree.combine(own, base))

  return algorithms.Algorithm(
      init=lambda params, class_counts, key: FedPerState(params, class_counts.sum(-1)),
      client_models=lambda state: state.params,
      loss=algorithms.cross_entropy_loss(model),
      optimizer=optimizer,
      server_update=server_update,
      evaluate=lambda state: {"personalized": state.params})


class DittoState(NamedTuple):
  """The global model `w`, each client's personal model `v`, and `n_i`."""
  global_model: Any
  personal: Any
  num_samples: Any


def ditto(model: nn.Module, optimizer: optax.GradientTransformation, *,
          lam: float = 0.1) -> algorithms.Algorithm:
  """Ditto (Li et al., ICML 2021): FedAvg's global model plus proximal personal models.

  Each client trains the pair `{"w", "v"}` on the same batches: `w` (from the
  global model) with cross-entropy, `v` with cross-entropy plus
  `lam/2 ||v - w_global||^2`. The server averages the `w`s.

  Args:
    model: the clients' Flax model.
    optimizer: the optimizer of each of the two models.
    lam: weight of the proximal term (>= 0); a float, so sweeps can trace it.
  """
  algorithms.check_range("lam", lam, 0.0)
  ce = algorithms.cross_entropy_loss(model)

  def loss(pair, global_model, batch, key):
    return (ce(pair["w"], None, batch, key) + ce(pair["v"], None, batch, key)
            + lam * losses.proximal(pair["v"], global_model))

  def broadcast_global(state):
    return tree.broadcast(state.global_model, state.num_samples.shape[0])

  def server_update(state, trained, mask, key):
    del key
    return state._replace(
        global_model=aggregate.fedavg(trained["w"], state.num_samples, mask=mask),
        personal=trained["v"])   # absent or faulty clients' entries are unchanged

  return algorithms.Algorithm(
      init=lambda params, class_counts, key: DittoState(
          jax.tree.map(lambda x: x[0], params), params, class_counts.sum(-1)),
      client_models=lambda state: {"w": broadcast_global(state), "v": state.personal},
      loss=loss,
      optimizer=algorithms.per_model(optimizer, ("w", "v")),
      server_update=server_update,
      evaluate=lambda state: {"personalized": state.personal,
                              "global": broadcast_global(state)},
      client_context=broadcast_global)
