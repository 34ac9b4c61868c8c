"""The engine's round split into a server's and a client's steps.

`pflax.simulate` runs a round of all clients as one program. A federation
outside the simulator (`pflax.flower`) runs the same round in pieces, on other
machines: the server draws the participants and gives each its starting model,
its loss's context and its training key (`round_tasks`, `client_task`); each
client trains on its own data with its architecture group's algorithm
(`client_update`); the server aggregates the uploads it received
(`server_step`). The pieces are the engine's (`pflax._src.simulation.engine`):
its initial state, key schedule, client training and server steps over every
architecture group (`pflax._src.simulation.groups`), so with the same seed,
data and algorithm they compute the engine's round, and a client whose upload
never arrives is dropped exactly as the engine drops a faulty one.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from pflax._src.core import prng
from pflax._src.core import types
from pflax._src.data import federation as federation_lib
from pflax._src.methods import algorithm as alg
from pflax._src.simulation import engine
from pflax._src.simulation import faults as faults_lib
from pflax._src.simulation import groups as groups_lib
from pflax._src.simulation import keys as keys_lib
from pflax._src.training import train as train_lib


class Tasks(NamedTuple):
  """What the server sends the participants of a round.

  Attributes:
    clients: `(P,)` the participants, sorted.
    starts: per group, its clients' `(m_g, ...)` starting models
      (`client_models(state)`).
    contexts: per group, its clients' `(m_g, ...)` loss contexts (None for a
      loss without one).
    keys: `(M, 2)` uint32 key data of every client's training key.
    server_key: the key of the round's server step.
  """
  clients: np.ndarray
  starts: engine.PerGroup
  contexts: tuple[types.Stacked | None, ...]
  keys: np.ndarray
  server_key: chex.PRNGKey


def _key_data(groups: groups_lib.Groups,
              group_keys: Callable[[int, chex.Array], chex.Array]) -> np.ndarray:
  """`(M, 2)` key data of every client's key `group_keys(g, positions)`, in
  client order."""
  parts = tuple(np.asarray(jax.random.key_data(group_keys(g, jnp.arange(len(index)))))
                for g, index in enumerate(groups.clients))
  return np.asarray(engine.in_client_order(groups, parts))


def training_keys(groups: groups_lib.Groups, seed: int, t: int
                  ) -> tuple[chex.PRNGKey, np.ndarray, chex.PRNGKey]:
  """Round `t`'s (from 0) participant key, `(M, 2)` client key data (each
  client's `group_training_keys`), server key."""
  sample_key, train_key, server_key = keys_lib.round_keys(keys_lib.run_keys(seed)[2], t)
  keys = _key_data(groups, functools.partial(keys_lib.group_training_keys, train_key))
  return sample_key, keys, server_key


def warmup_keys(groups: groups_lib.Groups, seed: int) -> np.ndarray:
  """`(M, 2)` key data of the clients' warm-up training keys."""
  return _key_data(groups, lambda g, ids: keys_lib.warmup_training_keys(seed, ids))


def key_from_data(data: Any) -> chex.PRNGKey:
  """A training key from the uint32 key data `round_tasks` sends."""
  return jax.random.wrap_key_data(jnp.asarray(np.asarray(data, np.uint32)),
                                  impl=prng.IMPL)


def round_tasks(groups: groups_lib.Groups, state: alg.State, seed: int, t: int,
                participation: float) -> Tasks:
  """Round `t`'s (from 0) participants and what each trains from."""
  sample_key, keys, server_key = training_keys(groups, seed, t)
  chosen = keys_lib.round_participants(sample_key, groups.num_clients, participation)
  return Tasks(np.asarray(chosen), groups.algorithm.client_models(state),
               groups.algorithm.client_context(state), keys, server_key)


def warmup_tasks(groups: groups_lib.Groups, state: alg.State, seed: int) -> Tasks:
  """The warm-up's tasks: every client trains, with its warm-up key."""
  return Tasks(np.arange(groups.num_clients), groups.algorithm.client_models(state),
               groups.algorithm.client_context(state), warmup_keys(groups, seed), None)


def client_row(groups: groups_lib.Groups, per_group: engine.PerGroup, client: int
               ) -> types.Tree:
  """Client `client`'s row of per-group stacked trees (host arrays)."""
  g, j = groups.position(client)
  return jax.tree.map(lambda x: np.asarray(x[j]), per_group[g])


def client_task(groups: groups_lib.Groups, tasks: Tasks, client: int
                ) -> tuple[types.Tree, types.Tree | None, np.ndarray]:
  """`(start, context, key data)` of client `client` in `tasks`."""
  context = tasks.contexts[groups.position(client)[0]]
  return (client_row(groups, tasks.starts, client),
          None if context is None else client_row(groups, tasks.contexts, client),
          tasks.keys[client])


@functools.lru_cache(maxsize=16)
def _trainer(member: alg.Algorithm, epochs: int, batch_size: int
             ) -> Callable[..., train_lib.ClientResult]:
  return jax.jit(engine.client_trainer(member, epochs, batch_size))


def client_update(member: alg.Algorithm, params: types.Tree,
                  opt_state: optax.OptState | None, context: types.Tree | None,
                  data: federation_lib.ClientData, key: chex.PRNGKey, *, epochs: int,
                  batch_size: int) -> train_lib.ClientResult:
  """One client's local training, as the engine trains it (`engine.client_trainer`).

  Args:
    member: the algorithm of the client's group (`Groups.members`).
    params, context: the client's task (`client_task`).
    opt_state: its optimizer state after its last round, used where the
      algorithm keeps it (`keep_opt_state`); None: a fresh one.
    data: its data.
    key: its training key (`key_from_data`).
    epochs, batch_size: local training.
  """
  return _trainer(member, epochs, batch_size)(params, opt_state, context, data.x,
                                              data.y, data.mask, key)


def finite(tree: types.Tree) -> bool:
  """Whether every entry of an (unstacked) tree is finite."""
  return bool(all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(tree)))


def with_uploads(groups: groups_lib.Groups, starts: engine.PerGroup,
                 uploads: dict[int, types.Tree]) -> tuple[engine.PerGroup, np.ndarray]:
  """`(trained, received)`: the starts with the received clients' uploads in place,
  and bool `(M,)` marking those clients.

  Raises:
    ValueError: for an upload that is not a tree of its group's structure.
  """
  received = np.zeros(groups.num_clients, bool)
  trained = jax.tree.map(np.array, starts)       # host copies to write rows into
  for i, upload in uploads.items():
    g, j = groups.position(i)
    leaves, structure = jax.tree.flatten(trained[g])
    if jax.tree.structure(upload) != structure:
      raise ValueError(f"client {i}'s upload is not a tree of the structure "
                       f"{structure}, got {jax.tree.structure(upload)}.")
    received[i] = True
    for full, row in zip(leaves, jax.tree.leaves(upload)):
      full[j] = row
  return trained, received


@functools.partial(jax.jit, static_argnums=(0, 6))
def _server_step(groups: groups_lib.Groups, state: alg.State, starts: engine.PerGroup,
                 trained: engine.PerGroup, received: chex.Array, key: chex.PRNGKey,
                 outlier_factor: float | None) -> tuple[alg.State, chex.Array]:
  return engine.server_step(groups, state, starts, trained, received, key,
                            outlier_factor)


def server_step(groups: groups_lib.Groups, state: alg.State, tasks: Tasks,
                uploads: dict[int, types.Tree], *,
                outlier_factor: float | None = faults_lib.OUTLIER_FACTOR
                ) -> tuple[alg.State, np.ndarray]:
  """The engine's `server_step` on the uploads received: `(state, healthy)`.

  A participant whose upload did not arrive, is not finite or whose update
  norm exceeds `outlier_factor` x the round's median is dropped, by the
  engine's rule (`faults.healthy_clients`): it counts as absent from the
  server step. A round with no healthy upload keeps the state.
  """
  trained, received = with_uploads(groups, tasks.starts, uploads)
  state, healthy = _server_step(groups, state, tasks.starts, trained, received,
                                tasks.server_key, outlier_factor or None)
  return state, np.asarray(healthy)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _warmup_step(groups: groups_lib.Groups, state: alg.State, starts: engine.PerGroup,
                 trained: engine.PerGroup, outlier_factor: float | None) -> alg.State:
  return engine.warmup_step(groups, state, starts, trained, outlier_factor)


def warmup_step(groups: groups_lib.Groups, state: alg.State,
                uploads: dict[int, types.Tree], *,
                outlier_factor: float | None = faults_lib.OUTLIER_FACTOR) -> alg.State:
  """The engine's `warmup_step` (`Algorithm.warmup`) on the uploads received,
  the non-finite and outlying ones dropped (`faults.healthy_clients`)."""
  starts = groups.algorithm.client_models(state)
  trained, _ = with_uploads(groups, starts, uploads)
  return _warmup_step(groups, state, starts, trained, outlier_factor or None)


@functools.lru_cache(maxsize=16)
def _counter(model: nn.Module) -> Callable[..., chex.Array]:
  return jax.jit(functools.partial(train_lib.evaluate_client,
                                   functools.partial(alg.logits, model)))


def correct_predictions(model: nn.Module, params: types.Tree,
                        data: federation_lib.ClientData) -> int:
  """Correctly classified test samples of one client with `params`."""
  return int(_counter(model)(params, data.test_x, data.test_y, data.test_mask))
