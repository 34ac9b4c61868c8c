"""Client-level differential privacy: Poisson sampling, clipping, the noised mean.

DP-FedAvg (McMahan et al. 2018, "Learning Differentially Private Recurrent
Language Models", ICLR 2018, Algorithm 1 with the fixed-denominator estimator
f~_f): each round every client takes part independently with probability q;
participant i's update `Delta_i` of the shared parameters is clipped to L2
norm C over all shared leaves jointly, `Delta_i * min(1, C / ||Delta_i||)`;
the server releases

    Delta = (sum_i clip(Delta_i) + N(0, (z C)^2 I)) / (q M),

with the denominator fixed at the expected number of participants `q M`, so
that adding or removing one client moves the noised sum by at most C (the
sensitivity the Gaussian mechanism's analysis needs). The privacy loss of T
such rounds is that of `PoissonSampledDpEvent(q, GaussianDpEvent(z))`
composed T times (`pflax.privacy.epsilon`).
"""

import chex
import jax
import jax.numpy as jnp

from pflax._src.core import checks
from pflax._src.core import types


def poisson_sample(key: chex.PRNGKey, num_clients: int, rate: float) -> chex.Array:
  """Bool `(num_clients,)`: each client independently True with probability `rate`.

  The sampling that `PoissonSampledDpEvent` analyses (McMahan et al. 2018,
  Algorithm 1: `C^t <- (sample users with probability q)`).

  >>> import jax
  >>> poisson_sample(jax.random.key(0), 4, 1.0).tolist()
  [True, True, True, True]
  """
  return jax.random.uniform(key, (num_clients,)) < rate


def update_norms(updates: types.Stacked) -> chex.Array:
  """`(M,)` each client's L2 norm over all leaves of `updates` jointly."""
  squares = [jnp.sum(jnp.square(x.astype(jnp.float32)).reshape(x.shape[0], -1), axis=1)
             for x in jax.tree.leaves(updates)]
  return jnp.sqrt(sum(squares))


def clip_deltas(updates: types.Stacked, clip_norm: chex.Numeric, *,
                mask: chex.Array | None = None) -> types.Stacked:
  """Each client's update scaled to L2 norm at most `clip_norm`; masked-out rows 0.

  `Delta_i * min(1, C / ||Delta_i||)`, the norm over all leaves jointly
  (McMahan et al. 2018, Algorithm 1, `ClipFn` flat clipping). A non-finite
  update counts as 0 (its client contributes nothing, which keeps the bound).

  Args:
    updates: stacked updates `w_i - w`, leaves `(M, ...)`.
    clip_norm: C > 0 (`jnp.inf`: no clipping).
    mask: optional bool `(M,)`: the clients whose updates count.

  Returns:
    The clipped updates, float32 leaves `(M, ...)`.

  Example:
    >>> import jax.numpy as jnp
    >>> out = clip_deltas({"w": jnp.array([[3.0, 4.0], [0.3, 0.4]])}, 1.0)
    >>> [[round(v, 4) for v in row] for row in out["w"].tolist()]
    [[0.6, 0.8], [0.3, 0.4]]
  """
  _, mask = checks.client_params(updates, mask)
  if checks.is_concrete(clip_norm) and not clip_norm > 0:
    raise ValueError(f"clip_norm must be > 0, got {clip_norm!r}.")
  norms = update_norms(updates)
  finite = jnp.isfinite(norms)
  keep = mask & finite if mask is not None else finite
  scale = jnp.where(keep, jnp.minimum(1.0, clip_norm / jnp.where(norms > 0, norms, 1.0)),
                    0.0)

  def clipped(x):
    x = jnp.where(keep.reshape((-1,) + (1,) * (x.ndim - 1)), x.astype(jnp.float32), 0.0)
    return x * scale.reshape((-1,) + (1,) * (x.ndim - 1))
  return jax.tree.map(clipped, updates)


def noisy_sum(clipped: types.Stacked, key: chex.PRNGKey, clip_norm: chex.Numeric,
              noise_multiplier: chex.Numeric) -> types.Tree:
  """`sum_i Delta_i + N(0, (z C)^2 I)`: the Gaussian mechanism on the sum of
  already clipped updates (one independent normal per coordinate, the leaves
  drawn from `fold_in(key, leaf index)`)."""
  leaves, treedef = jax.tree.flatten(clipped)
  z = jnp.asarray(noise_multiplier, jnp.float32)
  std = jnp.where(z == 0, 0.0, z * clip_norm)   # z = 0 with C = inf: no noise
  noised = [jnp.sum(x, axis=0) + std * jax.random.normal(
      jax.random.fold_in(key, i), x.shape[1:], jnp.float32)
            for i, x in enumerate(leaves)]
  return jax.tree.unflatten(treedef, noised)


def dp_mean(updates: types.Stacked, key: chex.PRNGKey, clip_norm: chex.Numeric,
            noise_multiplier: chex.Numeric, expected_participants: chex.Numeric, *,
            mask: chex.Array | None = None) -> types.Tree:
  """DP-FedAvg's noised mean update, `(sum_i clip(Delta_i) + N(0, (zC)^2 I)) / (qM)`.

  McMahan et al. 2018, Algorithm 1 with the fixed-denominator estimator
  (`f~_f`, weights 1, `W = q M`): with `noise_multiplier` 0 and `clip_norm`
  infinite it is the plain sum of the masked updates over `q M`.

  Args:
    updates: stacked updates `w_i - w`, leaves `(M, ...)`.
    key: the noise's key.
    clip_norm: C > 0.
    noise_multiplier: z >= 0 (the noise's std is z C).
    expected_participants: q M > 0, the fixed denominator.
    mask: optional bool `(M,)`: the round's participants.

  Returns:
    The mean update, float32 leaves without the client axis.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> out = dp_mean({"w": jnp.array([[3.0, 4.0], [0.3, 0.4]])}, jax.random.key(0),
    ...               1.0, 0.0, 2.0)
    >>> [round(v, 2) for v in out["w"].tolist()]
    [0.45, 0.6]
  """
  if checks.is_concrete(noise_multiplier) and not noise_multiplier >= 0:
    raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier!r}.")
  if checks.is_concrete(expected_participants) and not expected_participants > 0:
    raise ValueError("expected_participants (q M) must be > 0, got "
                     f"{expected_participants!r}.")
  total = noisy_sum(clip_deltas(updates, clip_norm, mask=mask), key, clip_norm,
                    noise_multiplier)
  return jax.tree.map(lambda x: x / expected_participants, total)
