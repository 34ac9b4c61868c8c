"""Clients in groups of one architecture each: the engine's form of an algorithm.

An `Algorithm` trains one model family: the engine runs it as one group of all
clients (`one_group`). `heterogeneous` wraps any algorithm whose server step
and client context read only some shared layers (FedClassAvg's classifier, or
FedAvg of a head): clients are dealt round robin to architectures that agree
on those layers only; the wrapped algorithm runs on the shared layers of all
clients, and the rest of each client's model is its own, trained locally.
"""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from pflax._src.core import tree as tree_lib
from pflax._src.core import types
from pflax._src.core import weights as weights_lib
from pflax._src.methods import algorithm as alg

Tuple = tuple[Any, ...]


class GroupWarmup(NamedTuple):
  """`Algorithm.warmup` in the group form: local training of every client
  before round 1, then `update`.

  Attributes:
    epochs: local epochs of the warm-up.
    update: `update(state, trained, masks) -> state`, with `trained` and
      `masks` per group as in `Groups.server_update`.
  """
  epochs: int
  update: Callable[[alg.State, Tuple, Tuple], alg.State]


class Groups(NamedTuple):
  """An algorithm over clients in architecture groups (the engine's form).

  Every function is over tuples with one entry per group: the `(m_g, ...)`
  stacked trees of the group's clients, `clients[g]` their indices.

  Attributes:
    models: each group's Flax model.
    clients: each group's client indices (a partition of `range(M)`).
    members: each group's `Algorithm`, for its local training (`loss`,
      `optimizer`, `keep_opt_state`, `unroll`).
    init: `init(params, class_counts, key) -> state`.
    client_models, client_context, evaluate: of the state, per group.
    server_update: `server_update(state, trained, masks, key) -> state`.
    warmup: the warm-up phase (`GroupWarmup`) or None.
  """
  models: tuple[nn.Module, ...]
  clients: tuple[np.ndarray, ...]
  members: tuple[alg.Algorithm, ...]
  init: Callable[[Tuple, chex.Array, chex.PRNGKey], alg.State]
  client_models: Callable[[alg.State], Tuple]
  client_context: Callable[[alg.State], Tuple]
  server_update: Callable[[alg.State, Tuple, Tuple, chex.PRNGKey], alg.State]
  evaluate: Callable[[alg.State], tuple[dict[str, types.Stacked], ...]]
  warmup: GroupWarmup | None


def one_group(algorithm: alg.Algorithm, model: nn.Module, num_clients: int) -> Groups:
  """`algorithm` on all `num_clients` clients of one architecture."""
  warm = algorithm.warmup
  return Groups(
      models=(model,), clients=(np.arange(num_clients),), members=(algorithm,),
      init=lambda params, counts, key: algorithm.init(params[0], counts, key),
      client_models=lambda state: (algorithm.client_models(state),),
      client_context=lambda state: (algorithm.client_context(state),),
      server_update=lambda state, trained, masks, key: algorithm.server_update(
          state, trained[0], masks[0], key),
      evaluate=lambda state: (algorithm.evaluate(state),),
      warmup=warm and GroupWarmup(warm.epochs, lambda state, trained, masks:
                                  warm.update(state, trained[0], masks[0])))


class Heterogeneous(NamedTuple):
  """An algorithm over clients of several architectures sharing some layers.

  Build with `heterogeneous`; run like any algorithm (`pflax.simulate`).
  """
  build: Callable[[nn.Module], alg.Algorithm]
  models: tuple[nn.Module, ...]
  shared: types.Selector


def heterogeneous(build: Callable[[nn.Module], alg.Algorithm],
                  models: Sequence[nn.Module],
                  shared: types.Selector = tree_lib.under("classifier", "output")
                  ) -> Heterogeneous:
  """Model heterogeneity around an algorithm that shares a head (FedClassAvg, Sec. 3.3).

  Client i uses `models[i % G]`. The layers that `shared` selects must have
  the same shapes in every model; the algorithm `build(model)` then runs on
  those layers of all clients (its state, server step, client context and
  evaluation see only them), while the other layers of each client's model
  are its own, trained locally and never aggregated. Each group trains with
  the loss and optimizer of `build(models[g])`.

  Args:
    build: `build(model) -> Algorithm`, e.g. `lambda m:
      pflax.algorithms.fedclassavg(m, optax.adam(1e-3))`. Its
      server step and client context must read only the shared layers.
    models: the G architectures.
    shared: selector of the shared layers (default the output layer).
  """
  if not models:
    raise ValueError("models must name at least one architecture.")
  return Heterogeneous(build, tuple(models), shared)


def _round_robin(num_clients: int, num_groups: int) -> tuple[np.ndarray, ...]:
  return tuple(np.arange(g, num_clients, num_groups)
               for g in range(min(num_groups, num_clients)))


def _gather(tree: Any, index: np.ndarray) -> Any:
  return jax.tree.map(lambda x: x[index], tree)


def _scatter(parts: Tuple, clients: tuple[np.ndarray, ...], num_clients: int) -> Any:
  """Rows of each group's stacked tree put back at its clients' indices."""
  def leaf(*xs):
    out = jnp.zeros((num_clients, *xs[0].shape[1:]), xs[0].dtype)
    for x, index in zip(xs, clients):
      out = out.at[index].set(x)
    return out
  return jax.tree.map(leaf, *parts)


class HeterogeneousState(NamedTuple):
  """The wrapped algorithm's state on the shared layers of all clients, and
  each group's stacked models (whose shared layers are not read)."""
  shared: Any
  own: Tuple


def as_groups(algorithm: alg.Algorithm | Heterogeneous, model: nn.Module,
              num_clients: int) -> Groups:
  """The engine's form of a plain (`model`) or heterogeneous algorithm."""
  if isinstance(algorithm, alg.Algorithm):
    return one_group(algorithm, model, num_clients)
  clients = _round_robin(num_clients, len(algorithm.models))
  models = algorithm.models[:len(clients)]
  members = tuple(algorithm.build(m) for m in models)
  inner, where = members[0], algorithm.shared
  heads = lambda trees: _scatter([tree_lib.selected(t, where) for t in trees], clients,
                                 num_clients)
  with_own = lambda full, state: tuple(
      tree_lib.with_selected(own, where, _gather(full, index))
      for index, own in zip(clients, state.own))

  def init(params, counts, key):
    return HeterogeneousState(inner.init(heads(params), counts, key), tuple(params))

  def updated(update, state, trained, masks, *key):
    mask = _scatter(masks, clients, num_clients)
    own = tuple(weights_lib.keep_masked(t, o, m)
                for t, o, m in zip(trained, state.own, masks))
    return HeterogeneousState(update(state.shared, heads(trained), mask, *key), own)

  def client_context(state):
    context = inner.client_context(state.shared)
    return tuple(None if context is None else _gather(context, index)
                 for index in clients)

  def evaluate(state):
    kinds = inner.evaluate(state.shared)
    per_kind = {kind: with_own(full, state) for kind, full in kinds.items()}
    return tuple({kind: models_[g] for kind, models_ in per_kind.items()}
                 for g in range(len(clients)))

  warm = inner.warmup
  return Groups(
      models=models, clients=clients, members=members, init=init,
      client_models=lambda state: with_own(inner.client_models(state.shared), state),
      client_context=client_context,
      server_update=lambda state, trained, masks, key: updated(
          inner.server_update, state, trained, masks, key),
      evaluate=evaluate,
      warmup=warm and GroupWarmup(warm.epochs, lambda state, trained, masks:
                                  updated(warm.update, state, trained, masks)))
