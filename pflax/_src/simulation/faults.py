"""Faulty clients and the server's health rule.

A round's faulty clients (`faulty_clients`, drawn from the participants key folded
with `FAULT_STREAM`) corrupt their uploads (`fault_kind`: NaN, their updates
scaled, an attack of `attack_updates`; or their class counts were inflated at
init, `lying_clients`). The server aggregates only the healthy participants
(`healthy_clients`): a finite upload whose update norm is not an outlier of the
round (`update_outliers`) and a plausible training loss (`plausible_losses`); a
round without any keeps the state (`keep_if_nobody`). The engine and a Flower
server apply the same rule.
"""

import chex
import jax
import jax.numpy as jnp

from pflax._src.core import types
from pflax._src.methods import algorithm as alg
from pflax._src.simulation import keys as keys_lib

FAULT_STREAM = 0xFA17
"""`fold_in(participants_key, FAULT_STREAM)` draws a round's faulty clients."""

OUTLIER_FACTOR = 1000.0
"""Default `outlier_factor`: an update norm above 1000x the round's median is dropped."""

MIN_OUTLIER_CLIENTS = 3
"""The outlier test needs this many finite participants with a non-zero update."""

MAX_LOSS = 1e6
"""The largest training loss a client may report; a larger one (or a non-finite
one) marks it unhealthy (`plausible_losses`): a mean cross-entropy of 1e6 is a
diverged model, not a measurement."""


def all_dropped(where: str, causes: str = "") -> str:
  """The one-line error of a round in which every participant was dropped;
  `where` names the round and the run ("round 3 of fedavg seed 0"), `causes`
  the setting's own causes of a drop besides the engine's health rule."""
  return (f"{where}: every participant was dropped ({causes}its upload not finite "
          "or an outlier, or its training loss not finite or beyond "
          f"{MAX_LOSS:g}): the training diverges; lower lr or set grad_clip "
          "(faulty_clients > 0 allows empty rounds).")


FAULT_KINDS = ("nan", "scaled", "inflated_counts", "sign_flip", "gaussian", "alie",
               "ipm")
"""`fault_kind`s: NaN uploads, updates times `fault_scale`, class counts times
`fault_scale` (a lie at registration), and the attacks of the Byzantine-robustness
literature (`attack_updates`): sign flipping, Gaussian noise, "a little is
enough" (ALIE) and inner-product manipulation (IPM)."""

DEFAULT_FAULT_SCALES = {"nan": 1.0, "scaled": 1e30, "inflated_counts": 10.0,
                        "sign_flip": 1.0, "gaussian": 1.0, "alie": 1.0, "ipm": 0.1}
"""`fault_scale` of each kind when None."""


def num_faulty(fraction: float, participants_: int) -> int:
  """`round(fraction * P)`: how many of a round's `P` participants are faulty."""
  return int(round(fraction * participants_))


def faulty_clients(key: chex.PRNGKey, took_part: chex.Array, count: int) -> chex.Array:
  """Bool `(M,)`: `count` of the clients that took part.

  Client i gets the score `uniform(fold_in(key, i))` and the participants
  with the lowest scores are faulty, so the draw does not depend on padding
  or on how clients are grouped.
  """
  ids = jnp.arange(took_part.shape[0])
  score = jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(key, i)))(ids)
  score = jnp.where(took_part, score, 2.0)
  rank = jnp.argsort(jnp.argsort(score))
  return took_part & (rank < count)


def upload_faults(trained: types.Stacked, faulty: chex.Array) -> types.Stacked:
  """The uploads with every entry of the faulty clients set to NaN."""
  def corrupt(x):
    return jnp.where(faulty.reshape((-1,) + (1,) * (x.ndim - 1)),
                     jnp.asarray(jnp.nan, x.dtype), x)
  return jax.tree.map(corrupt, trained)


def scale_updates(start: types.Stacked, trained: types.Stacked, faulty: chex.Array,
                  scale: float) -> types.Stacked:
  """The uploads with the faulty clients' updates multiplied by `scale`:
  `start + scale (trained - start)`, computed in float32."""
  def corrupt(s, x):
    bad = (s.astype(jnp.float32)
           + scale * (x.astype(jnp.float32) - s.astype(jnp.float32))).astype(x.dtype)
    return jnp.where(faulty.reshape((-1,) + (1,) * (x.ndim - 1)), bad, x)
  return jax.tree.map(corrupt, start, trained)


def _benign_moments(updates: chex.Array, benign: chex.Array
                    ) -> tuple[chex.Array, chex.Array]:
  """The coordinate-wise mean and (population) standard deviation of the
  benign clients' rows of one `(m, ...)` float32 leaf (zeros without any)."""
  rows = benign.reshape((-1,) + (1,) * (updates.ndim - 1))
  count = jnp.maximum(jnp.sum(benign), 1).astype(jnp.float32)
  mean = jnp.sum(jnp.where(rows, updates, 0.0), axis=0) / count
  var = jnp.sum(jnp.where(rows, jnp.square(updates - mean), 0.0), axis=0) / count
  return mean, jnp.sqrt(var)


def alie_z(num_participants: chex.Array, num_faulty_: chex.Array) -> chex.Array:
  """Baruch et al. 2019's `z_max` (Algorithm 3): with `s = floor(n/2 + 1) - f`
  workers to win over, `z_max = Phi^-1((n - s) / n)`."""
  n = num_participants.astype(jnp.float32)
  s = jnp.floor(n / 2 + 1) - num_faulty_.astype(jnp.float32)
  return jax.scipy.special.ndtri(jnp.clip((n - s) / jnp.maximum(n, 1), 1e-6, 1 - 1e-6))


def attack_updates(kind: str, start: types.Stacked, trained: types.Stacked,
                   faulty: chex.Array, benign: chex.Array, key: chex.PRNGKey,
                   scale: float, z: chex.Array) -> types.Stacked:
  """The uploads with the faulty clients' replaced by an attack on their updates
  `u_i = trained_i - start_i` (float32), colluding where the attack says so:

  - "sign_flip": `start_i - scale u_i` (each its own update, reversed);
  - "gaussian": `start_i + N(0, scale^2)` per coordinate, drawn from `key`;
  - "alie": `start_i + mu - scale z sigma`, `mu`, `sigma` the benign clients'
    coordinate-wise mean and standard deviation and `z` Baruch et al.'s
    `z_max` (`alie_z`): the same upload for every colluder;
  - "ipm": `start_i - scale mu` (Xie et al. 2020, epsilon = `scale`): the
    same for every colluder.

  The other clients' uploads are returned exactly as given.
  """
  leaves, structure = jax.tree.flatten(trained)
  keys = jax.random.split(key, len(leaves))

  def one(s, x, k):
    s32 = s.astype(jnp.float32)
    u = x.astype(jnp.float32) - s32
    if kind == "sign_flip":
      bad = s32 - scale * u
    elif kind == "gaussian":
      bad = s32 + scale * jax.random.normal(k, x.shape, jnp.float32)
    else:
      mean, std = _benign_moments(u, benign)
      bad = s32 + (mean - scale * z * std if kind == "alie" else -scale * mean)[None]
    rows = faulty.reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.where(rows, bad.astype(x.dtype), x)
  return jax.tree.unflatten(structure, [
      one(s, x, k) for s, x, k in zip(jax.tree.leaves(start), leaves, keys)])


def lying_clients(seed: chex.Array, num_real: int, padded: int,
                  fraction: float) -> chex.Array:
  """Bool `(padded,)`: the `round(fraction * M)` clients whose class counts are
  inflated for the whole run (`fault_kind` "inflated_counts"), drawn as
  `faulty_clients` from the run's init key."""
  real = jnp.arange(padded) < num_real
  key = jax.random.fold_in(keys_lib.run_keys(seed)[0], FAULT_STREAM)
  return faulty_clients(key, real, num_faulty(fraction, num_real))


def update_outliers(log2_norms: chex.Array, candidates: chex.Array,
                    outlier_factor: float | None) -> chex.Array:
  """Bool `(M,)`: candidates whose update norm exceeds `outlier_factor` x the median.

  The median is over the candidates with a finite, non-zero norm, taken in
  log2 (for an even number, the geometric mean of the two middle norms).
  Fewer than `MIN_OUTLIER_CLIENTS` such candidates (nobody to outvote a liar),
  or an `outlier_factor` of None or 0, mark nobody.

  Args:
    log2_norms: `(M,)` `log2 ||upload_i - start_i||` (`pflax.aggregate.log2_update_norms`).
    candidates: bool `(M,)`, the finite participants.
    outlier_factor: the factor, > 1, or None.
  """
  if not outlier_factor:
    return jnp.zeros_like(candidates)
  ok = candidates & jnp.isfinite(log2_norms)
  k = jnp.sum(ok)
  ordered = jnp.sort(jnp.where(ok, log2_norms, jnp.inf))
  last = ordered.shape[0] - 1
  mid = 0.5 * (ordered[jnp.clip((k - 1) // 2, 0, last)]
               + ordered[jnp.clip(k // 2, 0, last)])
  return ok & (k >= MIN_OUTLIER_CLIENTS) & (log2_norms > mid + jnp.log2(outlier_factor))


def healthy_clients(took_part: chex.Array, finite: chex.Array, log2_norms: chex.Array,
                    outlier_factor: float | None = OUTLIER_FACTOR) -> chex.Array:
  """Bool `(M,)`: the participants whose upload the server aggregates.

  A participant is unhealthy when its upload is not finite or its update norm
  is an outlier of the round (`update_outliers`); the engine and a Flower
  server (`pflax._src.simulation.protocol.server_step`) both apply this rule.
  """
  ok = took_part & finite
  return ok & ~update_outliers(log2_norms, ok, outlier_factor)


def plausible_losses(losses: chex.Array) -> chex.Array:
  """Bool `(M,)`: the clients whose reported training loss is finite and at most
  `MAX_LOSS` in magnitude; the others are unhealthy, like a non-finite upload,
  so that no 1e30 enters the round's loss."""
  return jnp.isfinite(losses) & (jnp.abs(losses) <= MAX_LOSS)


def keep_if_nobody(healthy: chex.Array, new: alg.State, old: alg.State) -> alg.State:
  """`new`, or `old` unchanged when no client is healthy (an empty round).

  Aggregators given no weight return zeros (global models) under `jit`; a
  round in which every upload was dropped must leave the server state as it was.
  """
  anyone = jnp.any(healthy)
  return jax.tree.map(lambda a, b: jnp.where(anyone, a, b), new, old)
