"""A run's key schedule: every random choice of a round derives from its seed.

`run_keys(seed)` gives the keys `(init, warm-up, rounds)`; `round_keys` folds the
round into the rounds key and splits it into `(participants, training, server)`;
each client trains with `fold_in(fold_in(training, group), client)`. The engine, a
Flower federation (`pflax._src.simulation.protocol`) and the differentiable run
draw the same keys, so a resumed run equals an uninterrupted one.
"""

import chex
import jax
import jax.numpy as jnp

from pflax._src.core import prng


def run_keys(seed: int | chex.Array) -> chex.Array:
  """The keys `(init, warm-up, rounds)` of a run, all derived from its seed."""
  return jax.random.split(prng.key(seed), 3)


def round_keys(round_key: chex.PRNGKey, t: int | chex.Array) -> chex.Array:
  """The keys `(participants, training, server)` of round `t`."""
  return jax.random.split(jax.random.fold_in(round_key, t), 3)


def client_keys(key: chex.PRNGKey, ids: chex.Array) -> chex.Array:
  """The training keys `fold_in(key, i)` of the clients `ids` (of one group)."""
  return jax.vmap(jax.random.fold_in, (None, 0))(key, ids)


def group_training_keys(train_key: chex.PRNGKey, g: int, ids: chex.Array) -> chex.Array:
  """A round's training keys of the clients at positions `ids` of group `g`:
  `fold_in(fold_in(train_key, g), i)`, whoever else takes part."""
  return client_keys(jax.random.fold_in(train_key, g), ids)


def warmup_training_keys(seed: int | chex.Array, ids: chex.Array) -> chex.Array:
  """The warm-up's training keys of the clients at positions `ids` of any group:
  `fold_in(warmup_key, i)` with the run's warm-up key (`run_keys`)."""
  return client_keys(run_keys(seed)[1], ids)


def num_participants(participation: float, num_clients: int) -> int:
  """`max(1, round(participation * M))` clients take part in a round."""
  return max(1, int(round(participation * num_clients)))


def participants(key: chex.PRNGKey, num_clients: int, participation: float) -> chex.Array:
  """A fixed number (`num_participants`) of distinct clients, sorted."""
  count = num_participants(participation, num_clients)
  return jnp.sort(jax.random.permutation(key, num_clients)[:count])


def round_participants(sample_key: chex.PRNGKey, num_clients: int,
                       participation: float) -> chex.Array:
  """A round's `participants`, drawn from `fold_in(sample_key, 0)` (`round_keys`)."""
  return participants(jax.random.fold_in(sample_key, 0), num_clients, participation)
