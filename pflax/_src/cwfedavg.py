"""Class-wise FedAvg (cwFedAvg): one FedAvg per class, mixed back per client.

With `P = [p_ij]` (clients' class distributions) and `Q = [q_ij]` (each client's
share of each class), the class models are `G = Q^T W` and the personalized
models `W' = P G = (P Q^T) W`: a rank-`min(M, K)` mixing of the stacked
parameters, computed in whichever order is cheaper.
"""

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from pflax._src import checks
from pflax._src import fedavg as fedavg_lib
from pflax._src import tree as tree_lib
from pflax._src import types
from pflax._src import weights as weights_lib


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
                  mask: chex.Array | None) -> ClassWeights:
  """Computes `p_i`, `p_ij` and `q_ij` from counts or from distributions."""
  class_dist = jnp.asarray(class_dist, jnp.float32)
  if num_samples is None:
    num_samples = jnp.sum(class_dist, axis=1)
  client = weights_lib.client_weights(num_samples, class_dist.shape[0], mask)
  dist = weights_lib.row_distribution(class_dist)
  return ClassWeights(client, dist, class_shares(dist, client))


def _check(params: types.Stacked, class_dist: chex.Array,
           num_samples: chex.Array | None, mask: chex.Array | None) -> int:
  m = fedavg_lib.check_params(params, mask)
  if np.ndim(class_dist) != 2:
    raise ValueError(f"class_dist must have shape (M, K) with M = {m}, got "
                     f"{np.shape(class_dist)}.")
  checks.shape(class_dist, "class_dist", (m, np.shape(class_dist)[1]), "(M, K)")
  checks.non_negative_finite(class_dist, "class_dist")
  weights_lib.check_client_vector(num_samples, m, "num_samples")
  return m


def cw_fedavg(params: types.Stacked, class_dist: chex.Array,
              num_samples: chex.Array | None = None, *,
              where: types.Selector | None = None,
              mask: chex.Array | None = None) -> types.Stacked:
  """Class-wise FedAvg: personalized models `w_i' = sum_j p_ij G_j` (Eq. 5-7).

  Class-specific global models `G_j = sum_i q_ij w_i` with
  `q_ij = p_i p_ij / sum_l p_l p_lj` (Eq. 5-6) are combined per client with its
  class distribution (Eq. 7), i.e. `W' = (P Q^T) W`.

  Args:
    params: stacked client parameters, leaves `(M, ...)`.
    class_dist: `(M, K)`. If `num_samples` is None, the counts `n_ij`; then
      `n_i = sum_j n_ij`, `p_i = n_i / sum_l n_l` and `p_ij = n_ij / n_i`.
      Otherwise each row is a (possibly unnormalised) distribution such as the
      estimate `p~` of `estimate_class_dist`, and `p_i` comes from `num_samples`.
    num_samples: optional `(M,)` sample counts.
    where: selector of the class-wise leaves; the other leaves get plain FedAvg
      with weights `p_i`, broadcast to every client. None selects every leaf
      ("cwFedAvg (All)"); `under("classifier", "output")` on pflax models is the
      paper's "cwFedAvg (Output)".
    mask: optional bool `(M,)`; False clients contribute nothing and get their
      own parameters back unchanged.

  Returns:
    Personalized stacked parameters, same structure and dtypes as `params`.

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

  References:
    Lee & Choi, "Class-Wise Federated Averaging for Efficient Personalization",
    Eq. (4)-(7); special cases in Sec. 4.3 (IID -> FedAvg, one class per client
    -> Eq. 9).
  """
  m = _check(params, class_dist, num_samples, mask)
  w = class_weights(class_dist, num_samples, mask)
  fedavg_row = w.client[None]
  safe = weights_lib.zero_masked(params, mask)
  mixed = tree_lib.map_selected(
      lambda x: tree_lib.mix_factored_leaf(w.dist, w.share.T, x),
      lambda x: tree_lib.broadcast_leaf(tree_lib.mix_leaf(fedavg_row, x)[0], m),
      safe, tree_lib.selection(params, where))
  return weights_lib.keep_masked(mixed, params, mask)


def class_models(params: types.Stacked, class_dist: chex.Array,
                 num_samples: chex.Array | None = None, *,
                 mask: chex.Array | None = None) -> types.Stacked:
  """Class-specific global models `G_j = sum_i q_ij w_i` (Eq. 5-6), stacked `(K, ...)`.

  Arguments as in `cw_fedavg`. Store the result between rounds and call
  `personalize` to give any client (participating or not) its model.
  """
  _check(params, class_dist, num_samples, mask)
  w = class_weights(class_dist, num_samples, mask)
  share_t = w.share.T
  safe = weights_lib.zero_masked(params, mask)
  return jax.tree.map(lambda x: tree_lib.mix_leaf(share_t, x), safe)


def personalize(class_models: types.Stacked, class_dist: chex.Array) -> types.Stacked:
  """Personalized models `w_i = sum_j p_ij G_j` (Eq. 7) from stored class models.

  Args:
    class_models: stacked `(K, ...)` class models.
    class_dist: `(M, K)` class distributions or counts (rows are normalised; a
      zero row is uniform).

  Returns:
    Stacked `(M, ...)` personalized parameters.
  """
  k = checks.num_clients(class_models, "class_models")
  checks.float_leaves(class_models, "class_models")
  if np.ndim(class_dist) != 2 or np.shape(class_dist)[1] != k:
    raise ValueError(f"class_dist must have shape (M, K) with K = {k} (the number "
                     f"of class models), got {np.shape(class_dist)}.")
  checks.non_negative_finite(class_dist, "class_dist")
  dist = weights_lib.row_distribution(class_dist)
  return jax.tree.map(lambda x: tree_lib.mix_leaf(dist, x), class_models)


def _safe_norm(x: chex.Array, axis: int) -> chex.Array:
  """Euclidean norm with a finite (zero) gradient at the origin."""
  sq = jnp.sum(jnp.square(x), axis=axis)
  positive = sq > 0
  return jnp.where(positive, jnp.sqrt(jnp.where(positive, sq, 1.0)), 0.0)


def estimate_class_dist(kernel: chex.Array) -> chex.Array:
  """Class distribution estimated from an output-layer kernel (Eq. 4).

  `p~_j = ||kernel[:, j]||_2 / sum_k ||kernel[:, k]||_2`: norms over the input
  axis of a Flax `Dense` kernel `(..., F, K)`, bias excluded, norms not squared.
  A kernel of all zeros gives the uniform `1/K`. Works stacked `(M, F, K)` or not.

  Args:
    kernel: `(..., F, K)` floating-point kernel.

  Returns:
    `(..., K)` float32 distributions.

  References:
    cwFedAvg paper Eq. (4).
  """
  if np.ndim(kernel) < 2:
    raise ValueError(f"kernel must have shape (..., F, K), got {np.shape(kernel)}.")
  checks.float_leaves(kernel, "kernel")
  norms = _safe_norm(jnp.asarray(kernel, jnp.float32), axis=-2)
  return weights_lib.row_distribution(norms)
