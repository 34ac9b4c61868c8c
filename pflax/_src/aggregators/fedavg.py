"""FedAvg and FedClassAvg: one weighted mean of the clients, global or per layer.

Each public function checks its inputs on the host, then runs one module-level
jitted program (the resolved selector is a static argument), so eager calls are
as fast as jitted ones after the first; inside a caller's `jit` it is inlined.
"""

import functools

import chex
import jax

from pflax._src.core import checks
from pflax._src.core import numerics
from pflax._src.core import tree as tree_lib
from pflax._src.core import types
from pflax._src.core import weights as weights_lib


def _num_clients(params: types.Stacked) -> int:
  return jax.tree.leaves(params)[0].shape[0]


@jax.jit
def _fedavg(params: types.Stacked, num_samples: chex.Array | None,
            mask: chex.Array | None) -> types.Tree:
  row = weights_lib.client_weights(num_samples, _num_clients(params), mask,
                                   numerics.weight_dtype(params))[None]
  safe = weights_lib.zero_masked(params, mask)
  return jax.tree.map(lambda x: tree_lib.mix_leaf(row, x)[0], safe)


def fedavg(params: types.Stacked, num_samples: chex.Array | None = None, *,
           mask: chex.Array | None = None) -> types.Tree:
  """Federated averaging: `w = sum_i p_i w_i` with `p_i = n_i / sum_l n_l`.

  Args:
    params: stacked client parameters, leaves `(M, ...)` with M >= 1 and real
      floating dtypes (a list of unstacked trees is an error: use
      `pflax.tree.stack`).
    num_samples: optional `(M,)` non-negative sample counts `n_i`; uniform if None.
    mask: optional bool `(M,)` (array or list); False clients contribute nothing
      (their parameters may even be non-finite).

  Returns:
    The global model: a tree without the client axis, in the input dtypes.

  Raises:
    ValueError: for concrete inputs where no unmasked client has a positive
      count (the message names `num_samples`) or `mask` is all False.

  Example:
    >>> import jax.numpy as jnp
    >>> from pflax.aggregate import fedavg
    >>> params = {"w": jnp.array([[0.0, 2.0], [4.0, 6.0]])}
    >>> fedavg(params, jnp.array([3, 1]))["w"]
    Array([1., 3.], dtype=float32)

  Notes:
    Weights are computed in float32, or float64 for float64 parameters, after
    scaling the counts by a power of two near their maximum (counts near
    float32's maximum are fine). Traced inputs (inside `jit`) with zero total
    weight give zeros.

  References:
    McMahan et al., "Communication-Efficient Learning of Deep Networks from
    Decentralized Data", AISTATS 2017; cwFedAvg paper Eq. (1).
  """
  m, mask = checks.client_params(params, mask)
  num_samples = weights_lib.check_client_vector(num_samples, m, "num_samples")
  checks.some_weight(num_samples, mask)
  return _fedavg(params, num_samples, mask)


@functools.partial(jax.jit, static_argnames="flags")
def _fedclassavg(params: types.Stacked, num_samples: chex.Array | None,
                 mask: chex.Array | None, flags: tuple[bool, ...]) -> types.Stacked:
  m = _num_clients(params)
  weights = weights_lib.client_weights(num_samples, m, mask,
                                       numerics.weight_dtype(params))

  def average(p: types.Stacked) -> types.Stacked:
    averaged = tree_lib.map_selected(
        lambda x: tree_lib.broadcast_leaf(tree_lib.mix_leaf(weights[None], x)[0], m),
        lambda x: x, weights_lib.zero_masked(p, mask), flags)
    return weights_lib.keep_masked(averaged, p, mask)

  return weights_lib.keep_if_weightless(weights, average, params)


def fedclassavg(params: types.Stacked, num_samples: chex.Array | None = None, *,
                where: types.Selector = tree_lib.under("classifier"),
                mask: chex.Array | None = None) -> types.Stacked:
  """Classifier averaging: selected leaves become their FedAvg mean in every client.

  `w_C <- sum_k |D_k| / |D| w_{C,k}` (FedClassAvg Eq. 3) for the leaves chosen by
  `where`; every other leaf (the feature extractor) is returned unchanged.

  For model-heterogeneous clients, concatenate the groups' classifier subtrees
  with `pflax.tree.concat`, call this function with `where=None`, and write each
  slice back to its group.

  Args:
    params: stacked client parameters (M >= 1, real floating leaves).
    num_samples: optional `(M,)` sample counts (uniform if None).
    where: selector of the classifier leaves (default: every leaf under a module
      named "classifier"); it must select at least one leaf. None selects all.
    mask: optional bool `(M,)`; False clients are left unchanged and excluded.

  Returns:
    Stacked parameters of the same structure.

  Raises:
    ValueError: if `where` selects no leaf (the message lists the top-level
      keys), or for concrete inputs with zero total weight (no unmasked client
      with a positive count, or an all-False `mask`).

  Notes:
    Traced inputs (inside `jit`) with zero total weight return `params`
    unchanged. Weights are float32, or float64 for float64 parameters.

  References:
    Jang et al., "FedClassAvg: Local Representation Learning for Personalized
    Federated Learning on Heterogeneous Neural Networks", ICPP 2022, Eq. (3).
  """
  m, mask = checks.client_params(params, mask)
  num_samples = weights_lib.check_client_vector(num_samples, m, "num_samples")
  flags = tuple(tree_lib.required_selection(params, where))
  checks.some_weight(num_samples, mask)
  return _fedclassavg(params, num_samples, mask, flags)
