"""Clients of several architectures around an algorithm that shares some layers.

`heterogeneous` wraps any algorithm whose server step and client context read
only some shared layers (FedClassAvg's classifier, or FedAvg of a head):
clients are dealt round robin to architectures that agree on those layers
only; the wrapped algorithm runs on the shared layers of all clients, and the
rest of each client's model is its own, trained locally. The result is an
`Algorithm` whose stacked clients are tuples, one `(m_g, ...)` tree per
architecture (`Algorithm.architectures`).
"""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from pflax._src.core import tree as tree_lib
from pflax._src.core import types
from pflax._src.core import weights as weights_lib
from pflax._src.methods import algorithm as alg

PerArchitecture = tuple[types.Stacked, ...]
"""One `(m_g, ...)` stacked tree per used architecture."""


class HeterogeneousState(NamedTuple):
  """The wrapped algorithm's state on the shared layers of all clients, and
  each architecture's stacked models (whose shared layers are not read)."""
  shared: alg.State
  own: PerArchitecture


def _gather(tree: Any, index: np.ndarray) -> Any:
  return jax.tree.map(lambda x: x[index], tree)


def _scatter(parts: PerArchitecture, clients: tuple[np.ndarray, ...]) -> types.Stacked:
  """Rows of each architecture's stacked tree put back at its clients' indices."""
  num_clients = sum(len(index) for index in clients)

  def leaf(*xs):
    out = jnp.zeros((num_clients, *xs[0].shape[1:]), xs[0].dtype)
    for x, index in zip(xs, clients):
      out = out.at[index].set(x)
    return out
  return jax.tree.map(leaf, *parts)


def heterogeneous(build: Callable[[nn.Module], alg.Algorithm],
                  models: Sequence[nn.Module],
                  shared: types.Selector = tree_lib.under("classifier", "output")
                  ) -> alg.Algorithm:
  """Model heterogeneity around an algorithm that shares a head (FedClassAvg, Sec. 3.3).

  Client i uses `models[i % G]`. The layers that `shared` selects must have
  the same shapes in every model; the algorithm `build(model)` then runs on
  those layers of all clients (its state, server step, client context and
  evaluation see only them), while the other layers of each client's model
  are its own, trained locally and never aggregated. Each architecture's
  clients train with the loss and optimizer of `build(models[g])`.

  Args:
    build: `build(model) -> Algorithm`, e.g. `lambda m:
      pflax.algorithms.fedclassavg(m, optax.adam(1e-3))`. Its
      server step and client context must read only the shared layers.
    models: the G architectures.
    shared: selector of the shared layers (default the output layer).

  Returns:
    An `Algorithm` with `architectures` set: its stacked clients are tuples
    with one `(m_g, ...)` tree per architecture that has clients, its state a
    `HeterogeneousState`.
  """
  if not models:
    raise ValueError("models must name at least one architecture.")
  architectures = alg.Architectures(tuple(models), tuple(build(m) for m in models),
                                    shared)
  inner = architectures.members[0]

  def clients_of(parts: PerArchitecture) -> tuple[np.ndarray, ...]:
    return architectures.clients(sum(tree_lib.num_clients(p) for p in parts))

  def heads(trees: PerArchitecture) -> types.Stacked:
    return _scatter([tree_lib.selected(t, shared) for t in trees], clients_of(trees))

  def with_own(full: types.Stacked, state: HeterogeneousState) -> PerArchitecture:
    return tuple(tree_lib.with_selected(own, shared, _gather(full, index))
                 for index, own in zip(clients_of(state.own), state.own))

  def init(params, counts, key):
    return HeterogeneousState(inner.init(heads(params), counts, key), tuple(params))

  def updated(update, state, trained, mask, *key):
    own = tuple(weights_lib.keep_masked(t, o, mask[index]) for t, o, index in
                zip(trained, state.own, clients_of(state.own)))
    return HeterogeneousState(update(state.shared, heads(trained), mask, *key), own)

  def client_context(state):
    context = inner.client_context(state.shared)
    return tuple(None if context is None else _gather(context, index)
                 for index in clients_of(state.own))

  def evaluate(state):
    per_kind = {kind: with_own(full, state)
                for kind, full in inner.evaluate(state.shared).items()}
    return tuple({kind: models_[g] for kind, models_ in per_kind.items()}
                 for g in range(len(state.own)))

  warm = inner.warmup
  return inner._replace(
      init=init,
      client_models=lambda state: with_own(inner.client_models(state.shared), state),
      client_context=client_context,
      server_update=lambda state, trained, mask, key: updated(
          inner.server_update, state, trained, mask, key),
      evaluate=evaluate,
      warmup=warm and warm._replace(update=lambda state, trained, mask: updated(
          warm.update, state, trained, mask)),
      architectures=architectures,
      private_update=None)
