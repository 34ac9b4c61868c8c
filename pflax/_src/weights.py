"""Small statistics shared by aggregators: client weights and class distributions.

Every aggregator in pflax first turns statistics (sample counts, class
distributions, similarities) into a small weight matrix and then mixes the stacked
parameters once; this module holds the statistics that several methods share, and
the masking rules that keep absent or faulty clients out of everyone's result.
"""

import chex
import jax
import jax.numpy as jnp

from pflax._src import checks
from pflax._src import types


def _safe_divide(num: chex.Array, den: chex.Array) -> chex.Array:
  """num / den where den > 0, else 0 (no NaN, finite gradients)."""
  ok = den > 0
  return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def client_weights(num_samples: chex.Array | None, num_clients: int,
                   mask: chex.Array | None = None) -> chex.Array:
  """FedAvg weights `p_i = n_i / sum_l n_l` over unmasked clients (uniform if None).

  Masked-out clients get weight 0 and the rest are renormalised.
  """
  n = (jnp.ones((num_clients,), jnp.float32) if num_samples is None
       else jnp.asarray(num_samples, jnp.float32))
  if mask is not None:
    n = jnp.where(mask, n, 0.0)
  return n / jnp.sum(n)


def row_distribution(class_dist: chex.Array) -> chex.Array:
  """Normalises each row of a non-negative `(..., K)` array to sum 1.

  A row with zero mass becomes uniform `1/K` (the cwFedAvg paper's initial p~).
  """
  class_dist = jnp.asarray(class_dist, jnp.float32)
  k = class_dist.shape[-1]
  total = jnp.sum(class_dist, axis=-1, keepdims=True)
  return jnp.where(total > 0, _safe_divide(class_dist, total), 1.0 / k)


def check_client_vector(x: chex.Array | None, num_clients: int, name: str) -> None:
  """Checks an optional per-client statistic: shape (M,), non-negative, finite."""
  if x is None:
    return
  checks.shape(x, name, (num_clients,), "(M,)")
  checks.non_negative_finite(x, name)


def zero_masked(stacked: types.Stacked, mask: chex.Array | None) -> types.Stacked:
  """Replaces masked-out clients by zeros, so NaN/inf cannot leak through a mix."""
  if mask is None:
    return stacked
  return jax.tree.map(
      lambda x: jnp.where(mask.reshape((-1,) + (1,) * (x.ndim - 1)), x,
                          jnp.zeros((), x.dtype)), stacked)


def keep_masked(new: types.Stacked, old: types.Stacked,
                mask: chex.Array | None) -> types.Stacked:
  """Unmasked clients take `new`; masked-out clients keep `old` unchanged."""
  if mask is None:
    return new
  return jax.tree.map(
      lambda a, b: jnp.where(mask.reshape((-1,) + (1,) * (a.ndim - 1)), a, b),
      new, old)
