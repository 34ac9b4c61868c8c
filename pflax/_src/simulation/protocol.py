"""The engine's round split into a server's and a client's steps.

`pflax.simulate` runs a round of all clients as one program. A federation
outside the simulator (`pflax.flower`) runs the same round in pieces, on other
machines: the server draws the participants and gives each its starting model,
its loss's context and its training key (`round_tasks`); each client trains on
its own data (`client_update`); the server aggregates the uploads it received
(`server_step`). The pieces are the engine's (`pflax._src.simulation.engine`): its key
schedule and its server steps on one architecture group, so with the same
seed, data and algorithm they compute the engine's round, and a client whose
upload never arrives is dropped exactly as the engine drops a faulty one.
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
from pflax._src.core import tree as tree_lib
from pflax._src.core import types
from pflax._src.data import federation as federation_lib
from pflax._src.methods import algorithm as alg
from pflax._src.methods import groups as groups_lib
from pflax._src.simulation import engine
from pflax._src.training import models
from pflax._src.training import train as train_lib


def initial_state(algorithm: alg.Algorithm, model: nn.Module, sample_input: chex.Array,
                  class_counts: chex.Array, seed: int) -> alg.State:
  """The algorithm's state before round 1, as the engine makes it from `seed`.

  Args:
    algorithm: the algorithm.
    model: its Flax model.
    sample_input: one input batch `(1, ...)` (its shape and dtype matter).
    class_counts: `(M, K)` training class counts of all clients.
    seed: the run's seed.
  """
  key = engine.run_keys(seed)[0]
  params = models.init_stacked(model, key, sample_input, class_counts.shape[0],
                               same_init=True)
  return algorithm.init(params, jnp.asarray(class_counts), key)


class Tasks(NamedTuple):
  """What the server sends the participants of a round.

  Attributes:
    clients: `(P,)` the participants, sorted.
    starts: `(M, ...)` every client's starting model (`client_models(state)`).
    contexts: `(M, ...)` every client's loss context (None if the loss has none).
    keys: `(M, 2)` uint32 key data of every client's training key.
    server_key: the key of the round's server step.
  """
  clients: np.ndarray
  starts: types.Stacked
  contexts: types.Stacked | None
  keys: np.ndarray
  server_key: chex.PRNGKey


def training_keys(seed: int, t: int, num_clients: int) -> tuple[np.ndarray, ...]:
  """Round `t`'s (from 0) participant key, `(M, 2)` client key data, server key."""
  sample_key, train_key, server_key = engine.round_keys(engine.run_keys(seed)[2], t)
  keys = engine.group_training_keys(train_key, 0, jnp.arange(num_clients))
  return sample_key, np.asarray(jax.random.key_data(keys)), server_key


def warmup_keys(seed: int, num_clients: int) -> np.ndarray:
  """`(M, 2)` key data of the clients' warm-up training keys."""
  keys = engine.warmup_training_keys(seed, jnp.arange(num_clients))
  return np.asarray(jax.random.key_data(keys))


def key_from_data(data: Any) -> chex.PRNGKey:
  """A training key from the uint32 key data `round_tasks` sends."""
  return jax.random.wrap_key_data(jnp.asarray(np.asarray(data, np.uint32)),
                                  impl=prng.IMPL)


def round_tasks(algorithm: alg.Algorithm, state: alg.State, seed: int, t: int,
                num_clients: int, participation: float) -> Tasks:
  """Round `t`'s (from 0) participants and what each trains from."""
  sample_key, keys, server_key = training_keys(seed, t, num_clients)
  chosen = engine.round_participants(sample_key, num_clients, participation)
  return Tasks(np.asarray(chosen), algorithm.client_models(state),
               algorithm.client_context(state), keys, server_key)


@functools.lru_cache(maxsize=16)
def _trainer(loss: train_lib.LossFn, optimizer: optax.GradientTransformation,
             unroll: int | bool | None, epochs: int, batch_size: int
             ) -> Callable[..., train_lib.ClientResult]:
  return jax.jit(functools.partial(train_lib.train_client, loss, optimizer,
                                   epochs=epochs, batch_size=batch_size, unroll=unroll))


def client_update(algorithm: alg.Algorithm, params: types.Tree,
                  opt_state: optax.OptState | None, context: types.Tree | None,
                  data: federation_lib.ClientData, key: chex.PRNGKey, *, epochs: int,
                  batch_size: int) -> train_lib.ClientResult:
  """One client's local training, as the engine trains it.

  `opt_state` is the client's optimizer state from its last round, used when
  the algorithm keeps it (`keep_opt_state`); None or otherwise a fresh one.
  """
  if opt_state is None or not algorithm.keep_opt_state:
    opt_state = algorithm.optimizer.init(params)
  train = _trainer(algorithm.loss, algorithm.optimizer, algorithm.unroll, epochs,
                   batch_size)
  return train(params, opt_state, context, data.x, data.y, data.mask, key)


def finite(tree: types.Tree) -> bool:
  """Whether every entry of an (unstacked) tree is finite."""
  return bool(all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(tree)))


def with_uploads(starts: types.Stacked, uploads: dict[int, types.Tree]
                 ) -> tuple[types.Stacked, np.ndarray]:
  """`(trained, received)`: the starts with the received clients' uploads in place,
  and bool `(M,)` marking those clients."""
  m = tree_lib.num_clients(starts)
  received = np.zeros(m, bool)
  trained = jax.tree.map(np.array, starts)       # a host copy to write rows into
  leaves, structure = jax.tree.flatten(trained)
  for i, upload in uploads.items():
    if jax.tree.structure(upload) != structure:
      raise ValueError(f"client {i}'s upload is not a tree of the structure "
                       f"{structure}, got {jax.tree.structure(upload)}.")
    received[i] = True
    for full, row in zip(leaves, jax.tree.leaves(upload)):
      full[i] = row
  return trained, received


def _one_group(algorithm: alg.Algorithm, starts: types.Stacked) -> groups_lib.Groups:
  """The engine's form of `algorithm` on the clients of `starts`: one group
  (whose model, which the server steps do not read, is not known here)."""
  return groups_lib.one_group(algorithm, None, tree_lib.num_clients(starts))


@functools.partial(jax.jit, static_argnums=(0, 6))
def _server_step(algorithm: alg.Algorithm, state: alg.State, starts: types.Stacked,
                 trained: types.Stacked, received: chex.Array, key: chex.PRNGKey,
                 outlier_factor: float | None) -> tuple[alg.State, chex.Array]:
  return engine.server_step(_one_group(algorithm, starts), state, (starts,), (trained,),
                            received, key, outlier_factor)


def server_step(algorithm: alg.Algorithm, state: alg.State, tasks: Tasks,
                uploads: dict[int, types.Tree], *,
                outlier_factor: float | None = engine.OUTLIER_FACTOR
                ) -> tuple[alg.State, np.ndarray]:
  """The engine's `server_step` on the uploads received: `(state, healthy)`.

  A participant whose upload did not arrive, is not finite or whose update
  norm exceeds `outlier_factor` x the round's median is dropped, by the
  engine's rule (`engine.healthy_clients`): it counts as absent from the
  server step. A round with no healthy upload keeps the state.
  """
  trained, received = with_uploads(tasks.starts, uploads)
  state, healthy = _server_step(algorithm, state, tasks.starts, trained, received,
                                tasks.server_key, outlier_factor or None)
  return state, np.asarray(healthy)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _warmup_step(algorithm: alg.Algorithm, state: alg.State, starts: types.Stacked,
                 trained: types.Stacked, outlier_factor: float | None) -> alg.State:
  return engine.warmup_step(_one_group(algorithm, starts), state, (starts,), (trained,),
                            outlier_factor)


def warmup_step(algorithm: alg.Algorithm, state: alg.State,
                uploads: dict[int, types.Tree], *,
                outlier_factor: float | None = engine.OUTLIER_FACTOR) -> alg.State:
  """The engine's `warmup_step` (`Algorithm.warmup`) on the uploads received,
  the non-finite and outlying ones dropped (`engine.healthy_clients`)."""
  starts = algorithm.client_models(state)
  trained, _ = with_uploads(starts, uploads)
  return _warmup_step(algorithm, state, starts, trained, outlier_factor or None)


@functools.lru_cache(maxsize=16)
def _counter(model: nn.Module) -> Callable[..., chex.Array]:
  return jax.jit(functools.partial(train_lib.evaluate_client,
                                   functools.partial(alg.logits, model)))


def correct_predictions(model: nn.Module, params: types.Tree, data: federation_lib.ClientData) -> int:
  """Correctly classified test samples of one client with `params`."""
  return int(_counter(model)(params, data.test_x, data.test_y, data.test_mask))
