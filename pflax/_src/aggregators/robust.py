"""Robust aggregation of global models: update norms, clipping, capped weights,
the coordinate-wise median and trimmed mean.

FedAvg trusts every upload and every declared count. These aggregators bound
what one dishonest client can do (docs/methods.md#robust-options): its update
norm (`clip_updates`), its share of the weights (`capped_weights`), or its
influence on any coordinate (`median`, `trimmed_mean`, which ignore counts).
Each has a NumPy reference in tests/references.py.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np

from pflax._src.core import checks
from pflax._src.core import numerics
from pflax._src.core import types
from pflax._src.core import weights as weights_lib


def _rows(mask: chex.Array, x: chex.Array) -> chex.Array:
  """`mask (M,)` shaped to broadcast against the leaf `x (M, ...)`."""
  return mask.reshape((-1,) + (1,) * (x.ndim - 1))


def log2_update_norms(params: types.Stacked, reference: types.Tree) -> chex.Array:
  """float32 `(M,)`: `log2 ||w_i - reference||` over the whole tree (-inf for 0).

  Each client's differences are scaled by a power of two near their largest
  magnitude before squaring (`numerics.scale_exponent`), so norms near
  float32's maximum (a 1e30 model) neither overflow nor lose the comparison.
  `reference` is a tree without the client axis, or a stacked tree (each
  client's own start). A non-finite client gives a non-finite value.
  """
  def diffs(x, r):
    r = jnp.asarray(r, jnp.float32)
    d = jnp.asarray(x, jnp.float32) - (r if r.ndim == x.ndim else r[None])
    return d.reshape(d.shape[0], -1)

  flat = jax.tree.leaves(jax.tree.map(diffs, params, reference))
  top = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(d), axis=1) for d in flat])
  exponent = numerics.scale_exponent(top)
  scale = numerics.power_of_two(-exponent, jnp.float32)[:, None]
  total = sum(jnp.sum(jnp.square(d * scale), axis=1) for d in flat)
  return 0.5 * jnp.log2(total) + exponent.astype(jnp.float32)


def _clip(params, reference, max_norm, mask):
  log_norm = log2_update_norms(params, reference)
  # factor = min(1, c / ||d||), in log2 so that huge norms stay finite.
  factor = jnp.exp2(jnp.minimum(0.0, jnp.log2(max_norm) - log_norm))
  if mask is not None:
    factor = jnp.where(mask, factor, 1.0)

  def one(x, r):
    r = jnp.asarray(r, jnp.float32)
    r = r if r.ndim == x.ndim else r[None]
    clipped = (r + _rows(factor, x) * (jnp.asarray(x, jnp.float32) - r)).astype(x.dtype)
    return jnp.where(_rows(factor < 1, x), clipped, x)   # the others exactly as sent
  return jax.tree.map(one, params, reference)


_clip_jit = jax.jit(_clip)


def clip_updates(params: types.Stacked, reference: types.Tree, max_norm: float, *,
                 mask: chex.Array | None = None) -> types.Stacked:
  """Each client's update scaled to norm at most `max_norm`.

  `w_i <- r + min(1, c / ||w_i - r||) (w_i - r)` with the norm over the whole
  tree (Geyer et al.'s and DP-FedAvg's clipping, without noise).

  Args:
    params: stacked client models, leaves `(M, ...)`.
    reference: the model the clients started from: a tree without the client
      axis (a global model) or stacked like `params`.
    max_norm: c > 0.
    mask: optional bool `(M,)`; masked clients are returned unchanged.

  Returns:
    Stacked parameters in the input dtypes.

  Example:
    >>> import jax.numpy as jnp
    >>> from pflax.aggregate import clip_updates
    >>> out = clip_updates({"w": jnp.array([[3.0, 4.0], [0.3, 0.4]])},
    ...                    {"w": jnp.zeros(2)}, 1.0)
    >>> round(float(jnp.linalg.norm(out["w"][0])), 4), out["w"][1]
    (1.0, Array([0.3, 0.4], dtype=float32))
  """
  _, mask = checks.client_params(params, mask)
  if checks.is_concrete(max_norm) and not max_norm > 0:
    raise ValueError(f"max_norm must be > 0, got {max_norm!r}.")
  return _clip_jit(params, reference, jnp.asarray(max_norm, jnp.float32), mask)


def _capped(num_samples, max_share, mask, m):
  n = jnp.ones((m,), jnp.float32) if num_samples is None else jnp.asarray(
      num_samples, jnp.float32)
  active = n > 0 if mask is None else (n > 0) & mask
  n = jnp.where(active, n, 0.0)
  # Infeasible caps (fewer than 1/s clients with weight) become uniform weights.
  cap = jnp.maximum(max_share, 1.0 / jnp.maximum(jnp.sum(active), 1))

  def weights(capped):
    # The uncapped clients share what the capped ones leave, in proportion to
    # their counts, rescaled among themselves (a 3e38 count, once capped, must
    # not flush the others' shares to zero).
    free = jnp.maximum(1.0 - cap * jnp.sum(capped), 0.0)
    rest = numerics.normalize(jnp.where(capped, 0.0, n))
    return jnp.where(capped, cap, rest * free)

  capped = jax.lax.fori_loop(
      0, m, lambda _, c: c | (weights(c) > cap), jnp.zeros(m, bool))
  return jnp.where(active, weights(capped), 0.0)


_capped_jit = jax.jit(_capped, static_argnums=3)


def capped_weights(num_samples: chex.Array | None, max_share: float, *,
                   mask: chex.Array | None = None) -> chex.Array:
  """FedAvg weights with no client above `max_share`: `p_i = min(s, c n_i)`.

  `c` is chosen so that the weights sum to 1 (water-filling: the clients above
  `s` are set to `s` and the others renormalized, until none is above). With
  fewer than `1/s` clients of positive weight the cap cannot be met and the
  weights are uniform over them.

  Args:
    num_samples: `(M,)` non-negative counts (near float32's maximum too).
    max_share: s in (0, 1].
    mask: optional bool `(M,)`; masked clients get weight 0.

  Returns:
    float32 `(M,)` weights summing to 1 (zeros when no client has weight).

  Example:
    >>> import jax.numpy as jnp
    >>> from pflax.aggregate import capped_weights
    >>> capped_weights(jnp.array([90.0, 5.0, 5.0, 0.0]), 0.5)
    Array([0.5 , 0.25, 0.25, 0.  ], dtype=float32)
  """
  if num_samples is None:
    raise ValueError("num_samples must be an (M,) array of counts, got None.")
  m = np.shape(num_samples)[0]
  num_samples = weights_lib.check_client_vector(num_samples, m, "num_samples")
  if mask is not None:
    checks.shape(mask, "mask", (m,), "(M,)")
    mask = jnp.asarray(mask, bool)
  if checks.is_concrete(max_share) and not 0 < max_share <= 1:
    raise ValueError(f"max_share must be in (0, 1], got {max_share!r}.")
  return _capped_jit(num_samples, jnp.asarray(max_share, jnp.float32), mask, m)


def _order_statistics(x: chex.Array, mask: chex.Array | None
                      ) -> tuple[chex.Array, chex.Array]:
  """`(sorted, k)`: the leaf's unmasked clients sorted along axis 0 in float32
  (masked ones moved to the end as +inf), and their number k."""
  x = jnp.asarray(x, jnp.float32)
  if mask is None:
    return jnp.sort(x, axis=0), jnp.asarray(x.shape[0], jnp.int32)
  x = jnp.where(_rows(mask, x), x, jnp.inf)
  return jnp.sort(x, axis=0), jnp.sum(mask).astype(jnp.int32)


def _median_leaf(x, mask):
  s, k = _order_statistics(x, mask)
  lo = jnp.clip((k - 1) // 2, 0, x.shape[0] - 1)
  hi = jnp.clip(k // 2, 0, x.shape[0] - 1)
  take = lambda i: jax.lax.dynamic_index_in_dim(s, i, 0, keepdims=False)
  mid = 0.5 * take(lo) + 0.5 * take(hi)
  return jnp.where(k > 0, mid, 0.0).astype(x.dtype)


@jax.jit
def _median(params, mask):
  return jax.tree.map(lambda x: _median_leaf(x, mask), params)


def median(params: types.Stacked, *, mask: chex.Array | None = None) -> types.Tree:
  """The coordinate-wise median of the unmasked clients (unweighted).

  For an even number k of clients, the mean of the two middle values.

  Args:
    params: stacked client models, leaves `(M, ...)`, real floating dtypes.
    mask: optional bool `(M,)`; masked clients are ignored (they may be
      non-finite).

  Returns:
    A tree without the client axis, in the input dtypes (zeros under `jit`
    when no client is unmasked).

  Raises:
    ValueError: for a concrete all-False `mask`.

  Example:
    >>> import jax.numpy as jnp
    >>> from pflax.aggregate import median
    >>> median({"w": jnp.array([[0.0], [1.0], [1e30]])})["w"]
    Array([1.], dtype=float32)

  References:
    Yin et al., "Byzantine-Robust Distributed Learning: Towards Optimal
    Statistical Rates", ICML 2018 (coordinate-wise median).
  """
  _, mask = checks.client_params(params, mask)
  checks.some_weight(None, mask)
  return _median(params, mask)


def _trimmed_leaf(x, trim_fraction, mask):
  s, k = _order_statistics(x, mask)
  t = jnp.floor(trim_fraction * k).astype(jnp.int32)
  rank = jnp.arange(x.shape[0]).reshape((-1,) + (1,) * (x.ndim - 1))
  keep = (rank >= t) & (rank < k - t)
  total = jnp.sum(jnp.where(keep, s, 0.0), axis=0)
  count = jnp.maximum(k - 2 * t, 1).astype(jnp.float32)
  return jnp.where(k > 0, total / count, 0.0).astype(x.dtype)


@jax.jit
def _trimmed_mean(params, trim_fraction, mask):
  return jax.tree.map(lambda x: _trimmed_leaf(x, trim_fraction, mask), params)


def trimmed_mean(params: types.Stacked, *, trim_fraction: float = 0.1,
                 mask: chex.Array | None = None) -> types.Tree:
  """The coordinate-wise trimmed mean of the unmasked clients (unweighted).

  Per coordinate, the `t = floor(beta k)` largest and `t` smallest of the k
  unmasked values are dropped and the rest averaged.

  Args:
    params: stacked client models, leaves `(M, ...)`, real floating dtypes.
    trim_fraction: beta in [0, 0.5).
    mask: optional bool `(M,)`; masked clients are ignored.

  Returns:
    A tree without the client axis, in the input dtypes.

  Example:
    >>> import jax.numpy as jnp
    >>> from pflax.aggregate import trimmed_mean
    >>> trimmed_mean({"w": jnp.array([[0.0], [1.0], [2.0], [1e30]])},
    ...              trim_fraction=0.25)["w"]
    Array([1.5], dtype=float32)

  References:
    Yin et al., ICML 2018 (coordinate-wise trimmed mean).
  """
  _, mask = checks.client_params(params, mask)
  checks.some_weight(None, mask)
  if checks.is_concrete(trim_fraction) and not 0 <= trim_fraction < 0.5:
    raise ValueError(f"trim_fraction must be in [0, 0.5), got {trim_fraction!r}.")
  return _trimmed_mean(params, jnp.asarray(trim_fraction, jnp.float32), mask)
