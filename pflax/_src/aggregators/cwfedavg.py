"""Class-wise FedAvg (cwFedAvg): one FedAvg per class, mixed back per client.

With `P = [p_ij]` (clients' class distributions) and `Q = [q_ij]` (each client's
share of each class), both from `class_weights`, the class models are
`G = Q^T W` (`class_average`, Eq. 6) and the personalized models `W' = P G`
(`class_mixture`, Eq. 7). `cw_fedavg` is the two in a row on the class-wise
leaves (`class_wise`, one rank-`min(M, K)` mix computed in whichever order is
cheaper) and `fedavg.average` with weights `p_i` on the others; `class_models`
and `personalize` are the two steps apart, for a server that keeps `G`.

Each public function checks its inputs on the host, then runs one module-level
jitted program, so eager calls are as fast as jitted ones after the first.
"""

import functools
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from pflax._src.aggregators import fedavg as fedavg_lib
from pflax._src.core import checks
from pflax._src.core import numerics
from pflax._src.core import tree as tree_lib
from pflax._src.core import types
from pflax._src.core import weights as weights_lib

# Eq. (4) is a statistic, so it lives in `weights`; re-exported for its callers.
estimate_class_dist = weights_lib.estimate_class_dist


class ClassWeights(NamedTuple):
  """The statistics of Eq. (5)-(7).

  Attributes:
    client: `(M,)` FedAvg weights `p_i`.
    dist: `(M, K)` class distributions `p_ij` (rows sum to 1).
    share: `(M, K)` class-model weights `q_ij` (columns sum to 1).
  """
  client: chex.Array
  dist: chex.Array
  share: chex.Array


def class_shares(dist: chex.Array, client: chex.Array) -> chex.Array:
  """`q_ij = p_i p_ij / sum_l p_l p_lj` (Eq. 6); FedAvg weights for absent classes."""
  joint = client[:, None] * dist
  total = jnp.sum(joint, axis=0, keepdims=True)
  present = total > 0
  return jnp.where(present, joint / jnp.where(present, total, 1.0), client[:, None])


def class_weights(class_dist: chex.Array, num_samples: chex.Array | None,
                  mask: chex.Array | None,
                  dtype: jnp.dtype = jnp.float32) -> ClassWeights:
  """Computes `p_i`, `p_ij` and `q_ij` from counts or from distributions, in `dtype`.

  Counts are scaled by a power of two near their maximum before any sum (the
  weights do not depend on the scale), so counts near the dtype's maximum
  cannot overflow. Masked-out clients' rows are ignored (even if non-finite).
  """
  class_dist = jnp.asarray(class_dist, dtype)
  if mask is not None:
    class_dist = jnp.where(mask[:, None], class_dist, 0.0)
  if num_samples is None:
    shares = numerics.normalize(class_dist.reshape(-1), dtype)
    num_samples = jnp.sum(shares.reshape(class_dist.shape), axis=1)
  client = weights_lib.client_weights(num_samples, class_dist.shape[0], mask, dtype)
  dist = weights_lib.row_distribution(class_dist, dtype)
  return ClassWeights(client, dist, class_shares(dist, client))


def _check(params: types.Stacked, class_dist: chex.Array,
           num_samples: chex.Array | None,
           mask: chex.Array | None) -> tuple[chex.Array | None, chex.Array | None]:
  """Boundary checks of `cw_fedavg` / `class_models`; returns `(num_samples, mask)`."""
  m, mask = checks.client_params(params, mask)
  if np.ndim(class_dist) != 2:
    raise ValueError(f"class_dist must have shape (M, K) with M = {m}, got "
                     f"{np.shape(class_dist)}.")
  checks.shape(class_dist, "class_dist", (m, np.shape(class_dist)[1]), "(M, K)")
  if np.shape(class_dist)[1] == 0:
    raise ValueError(f"class_dist must have shape (M, K) with K >= 1 classes, got "
                     f"{np.shape(class_dist)}.")
  checks.non_negative_finite(class_dist, "class_dist")
  num_samples = weights_lib.check_client_vector(num_samples, m, "num_samples")
  if num_samples is None:
    checks.some_weight(class_dist, mask, "class_dist")
  else:
    checks.some_weight(num_samples, mask, "num_samples")
  return num_samples, mask


def class_average(params: types.Stacked, w: ClassWeights,
                  mask: chex.Array | None = None) -> types.Stacked:
  """Class models `G = Q^T W`, `G_j = sum_i q_ij w_i` (Eq. 6), stacked `(K, ...)`.

  Masked-out clients (weight 0) are zeroed first. No checks (as `fedavg.average`).
  """
  share_t = w.share.T
  return jax.tree.map(lambda x: tree_lib.mix_leaf(share_t, x),
                      weights_lib.zero_masked(params, mask))


def class_mixture(class_models: types.Stacked, dist: chex.Array) -> types.Stacked:
  """Personalized models `W' = P G`, `w_i = sum_j p_ij G_j` (Eq. 7), for row
  distributions `dist` (`weights.row_distribution`). No checks."""
  return jax.tree.map(lambda g: tree_lib.mix_leaf(dist, g), class_models)


def class_wise(params: types.Stacked, w: ClassWeights,
               mask: chex.Array | None = None) -> types.Stacked:
  """Eq. (6) then (7): `class_mixture(class_average(params, w, mask), w.dist)`.

  Computed as one mix per leaf in whichever order costs fewer multiply-adds
  (`tree.mix_factored_leaf`): for K > M/2 (and leaves of more than M entries),
  `(P Q^T) W`, which reads and writes the parameters once and never stores the
  `(K, ...)` class models; otherwise `P (Q^T W)` without rounding the class
  models to the parameters' dtype.
  """
  return jax.tree.map(lambda x: tree_lib.mix_factored_leaf(w.dist, w.share.T, x),
                      weights_lib.zero_masked(params, mask))


@functools.partial(jax.jit, static_argnames="flags")
def _cw_fedavg(params: types.Stacked, class_dist: chex.Array,
               num_samples: chex.Array | None, mask: chex.Array | None,
               flags: tuple[bool, ...]) -> types.Stacked:
  m = class_dist.shape[0]
  w = class_weights(class_dist, num_samples, mask, numerics.weight_dtype(params))

  def personalized(p: types.Stacked) -> types.Stacked:
    layers, rest = tree_lib.partition_flags(p, flags)
    mixed = tree_lib.combine(
        class_wise(layers, w, mask),                                        # Eq. 5-7
        tree_lib.broadcast(fedavg_lib.average(rest, w.client, mask), m))    # Eq. 1
    return weights_lib.keep_masked(mixed, p, mask)

  return weights_lib.keep_if_weightless(w.client, personalized, params)


def cw_fedavg(params: types.Stacked, class_dist: chex.Array,
              num_samples: chex.Array | None = None, *,
              where: types.Selector | None = None,
              mask: chex.Array | None = None) -> types.Stacked:
  """Class-wise FedAvg: personalized models `w_i' = sum_j p_ij G_j` (Eq. 5-7).

  Class-specific global models `G_j = sum_i q_ij w_i` with
  `q_ij = p_i p_ij / sum_l p_l p_lj` (Eq. 5-6) are combined per client with its
  class distribution (Eq. 7), i.e. `W' = (P Q^T) W`: on the leaves `where`
  selects, `personalize(class_models(params, ...), class_dist)`; on the others,
  `fedavg` broadcast to every client.

  Args:
    params: stacked client parameters, leaves `(M, ...)` with M >= 1 and real
      floating dtypes (a list of unstacked trees is an error: use
      `pflax.tree.stack`).
    class_dist: `(M, K)`, K >= 1. If `num_samples` is None, the counts `n_ij`;
      then `n_i = sum_j n_ij`, `p_i = n_i / sum_l n_l` and `p_ij = n_ij / n_i`.
      Otherwise each row is a (possibly unnormalised) distribution such as the
      estimate `p~` of `estimate_class_dist`, and `p_i` comes from `num_samples`.
    num_samples: optional `(M,)` sample counts.
    where: selector of the class-wise leaves; the other leaves get plain FedAvg
      with weights `p_i`, broadcast to every client. None selects every leaf
      ("cwFedAvg (All)"); `under("classifier", "output")` on pflax models is the
      paper's "cwFedAvg (Output)". A selector that selects no leaf is an error.
    mask: optional bool `(M,)` (array or list); False clients contribute nothing
      and get their own parameters back unchanged.

  Returns:
    Personalized stacked parameters, same structure and dtypes as `params`.

  Raises:
    ValueError: if `where` selects no leaf (the message lists the top-level
      keys), or for concrete inputs with zero total weight: every unmasked
      row of `class_dist` is zero (counts mode), every unmasked `num_samples`
      is zero, or `mask` is all False.

  Example:
    >>> params = {"w": jnp.array([[1.0], [3.0]])}
    >>> counts = jnp.array([[10, 0], [0, 10]])   # one class per client
    >>> cw_fedavg(params, counts)["w"]            # each keeps its class model
    Array([[1.],
           [3.]], dtype=float32)

  Notes:
    [settled] A class no client holds (`sum_l p_l p_lj = 0`) gets FedAvg weights
    `q_ij = p_i`; it has no effect on any personalized model. A row of
    `class_dist` with zero mass is treated as uniform `1/K`.
    Weights are computed in float32 (float64 for float64 parameters) after
    scaling the counts by a power of two near their maximum, so counts near
    float32's maximum are fine. Traced inputs (inside `jit`) with zero total weight return
    `params` unchanged.
    Class models then personalization are computed as one mix per leaf, in
    whichever order costs fewer multiply-adds: `(P Q^T) W` for K > M/2 (at
    K = M half the arithmetic and memory traffic of `P (Q^T W)`), else
    `P (Q^T W)`; the class models are neither stored nor rounded to the
    parameters' dtype, so float32 results can differ from
    `personalize(class_models(...))` in the last bits, and bfloat16 ones are
    rounded once.

  References:
    Lee & Choi, "Class-Wise Federated Averaging for Efficient Personalization",
    Eq. (4)-(7); special cases in Sec. 4.3 (IID -> FedAvg, one class per client
    -> Eq. 9).
  """
  num_samples, mask = _check(params, class_dist, num_samples, mask)
  flags = tuple(tree_lib.required_selection(params, where))
  return _cw_fedavg(params, jnp.asarray(class_dist), num_samples, mask, flags)


@jax.jit
def _class_models(params: types.Stacked, class_dist: chex.Array,
                  num_samples: chex.Array | None,
                  mask: chex.Array | None) -> types.Stacked:
  w = class_weights(class_dist, num_samples, mask, numerics.weight_dtype(params))
  return class_average(params, w, mask)


def class_models(params: types.Stacked, class_dist: chex.Array,
                 num_samples: chex.Array | None = None, *,
                 mask: chex.Array | None = None) -> types.Stacked:
  """Class-specific global models `G_j = sum_i q_ij w_i` (Eq. 5-6), stacked `(K, ...)`.

  Arguments, errors and weights' dtype as in `cw_fedavg`. Store the result
  between rounds and call `personalize` to give any client (participating or
  not) its model. Traced inputs (inside `jit`) with zero total weight give
  class models of zeros.
  """
  num_samples, mask = _check(params, class_dist, num_samples, mask)
  return _class_models(params, jnp.asarray(class_dist), num_samples, mask)


@jax.jit
def _personalize(class_models: types.Stacked, class_dist: chex.Array) -> types.Stacked:
  dist = weights_lib.row_distribution(class_dist, numerics.weight_dtype(class_models))
  return class_mixture(class_models, dist)


def personalize(class_models: types.Stacked, class_dist: chex.Array) -> types.Stacked:
  """Personalized models `w_i = sum_j p_ij G_j` (Eq. 7) from stored class models.

  Args:
    class_models: stacked `(K, ...)` class models, K >= 1.
    class_dist: `(M, K)` class distributions or counts (rows are normalised; a
      zero row is uniform; rows are scaled by a power of two near their
      maximum first, so counts near float32's maximum are fine).

  Returns:
    Stacked `(M, ...)` personalized parameters.
  """
  k = checks.stacked_clients(class_models, "class_models")
  checks.float_leaves(class_models, "class_models")
  if np.ndim(class_dist) != 2 or np.shape(class_dist)[1] != k:
    raise ValueError(f"class_dist must have shape (M, K) with K = {k} (the number "
                     f"of class models), got {np.shape(class_dist)}.")
  checks.non_negative_finite(class_dist, "class_dist")
  return _personalize(class_models, jnp.asarray(class_dist))
