"""Clients in groups of one architecture each: the engine's form of an algorithm.

Every algorithm runs in the engine as one or more groups of clients
(`as_groups`): one group of all clients for a plain `Algorithm`, one per used
architecture for an algorithm with `architectures`
(`pflax.algorithms.heterogeneous`). Whatever the groups, the engine speaks
tuples with one `(m_g, ...)` stacked tree per group.
"""

from typing import NamedTuple

import flax.linen as nn
import jax
import numpy as np

from pflax._src.core import types
from pflax._src.methods import algorithm as alg


class Groups(NamedTuple):
  """An algorithm over clients in architecture groups (the engine's form).

  Client i is row `i // G` of group `i % G` (round robin over the G groups).

  Attributes:
    algorithm: the algorithm over per-group tuples: its `init`,
      `client_models`, `client_context`, `server_update` (with the `(M,)`
      mask), `evaluate` and `warmup` speak one `(m_g, ...)` tree per group.
    models: each group's Flax model.
    members: each group's `Algorithm`, which trains the group's clients
      (`loss`, `optimizer`, `keep_opt_state`, `unroll`).
    num_clients: M, all groups' clients.
  """
  algorithm: alg.Algorithm
  models: tuple[nn.Module, ...]
  members: tuple[alg.Algorithm, ...]
  num_clients: int

  @property
  def clients(self) -> tuple[np.ndarray, ...]:
    """Each group's client indices (a partition of `range(M)`)."""
    return alg.round_robin(self.num_clients, len(self.models))

  def split(self, stacked: types.Stacked) -> tuple[types.Stacked, ...]:
    """Each group's rows of an `(M, ...)` stacked tree (the tree itself for one
    group)."""
    if len(self.models) == 1:
      return (stacked,)
    return tuple(jax.tree.map(lambda x, i=index: x[i], stacked)
                 for index in self.clients)

  def position(self, client: int) -> tuple[int, int]:
    """`(g, j)`: client `client` is row j of group g."""
    return client % len(self.models), client // len(self.models)


def _one_group(algorithm: alg.Algorithm) -> alg.Algorithm:
  """`algorithm` speaking 1-tuples: one group of all clients."""
  warm = algorithm.warmup
  return algorithm._replace(
      init=lambda params, counts, key: algorithm.init(params[0], counts, key),
      client_models=lambda state: (algorithm.client_models(state),),
      client_context=lambda state: (algorithm.client_context(state),),
      server_update=lambda state, trained, mask, key: algorithm.server_update(
          state, trained[0], mask, key),
      evaluate=lambda state: (algorithm.evaluate(state),),
      warmup=warm and warm._replace(update=lambda state, trained, mask: warm.update(
          state, trained[0], mask)))


def as_groups(algorithm: alg.Algorithm, model: nn.Module,
              num_clients: int) -> Groups:
  """The engine's form of `algorithm` on `num_clients` clients.

  Args:
    algorithm: a plain algorithm (one group of all clients, of `model`), or
      one with `architectures` (a group per architecture with clients).
    model: the plain algorithm's Flax model (unused with `architectures`).
    num_clients: M.
  """
  architectures = algorithm.architectures
  if architectures is None:
    return Groups(_one_group(algorithm), (model,), (algorithm,), num_clients)
  used = len(architectures.clients(num_clients))
  return Groups(algorithm, architectures.models[:used], architectures.members[:used],
                num_clients)
