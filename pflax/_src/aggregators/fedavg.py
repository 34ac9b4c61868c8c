"""FedAvg: one weighted mean of the clients.

`average` is the mean given its weights: `fedavg` is `client_weights` then
`average`, and the aggregators with a FedAvg part (cwFedAvg's other layers,
FedClassAvg's classifier, FedReMa's feature extractor, FedSA's low-dispersion
positions) call `average` inside their own jitted programs, so the mean is
written once.

`fedavg` checks its inputs on the host, then runs one module-level jitted
program, so eager calls are as fast as jitted ones after the first; inside a
caller's `jit` it is inlined.
"""

import chex
import jax

from pflax._src.core import checks
from pflax._src.core import numerics
from pflax._src.core import tree as tree_lib
from pflax._src.core import types
from pflax._src.core import weights as weights_lib


def average(params: types.Stacked, weights: chex.Array,
            mask: chex.Array | None = None) -> types.Tree:
  """`w = sum_i p_i w_i` for given FedAvg weights `p` (`weights.client_weights`).

  Masked-out clients (weight 0) are zeroed first, so their NaN or inf cannot
  leak into the mean. No checks: the callers' public functions check. Leaves
  may be None (a half of `tree.partition`).
  """
  row = weights[None]
  return jax.tree.map(lambda x: tree_lib.mix_leaf(row, x)[0],
                      weights_lib.zero_masked(params, mask))


@jax.jit
def _fedavg(params: types.Stacked, num_samples: chex.Array | None,
            mask: chex.Array | None) -> types.Tree:
  m = jax.tree.leaves(params)[0].shape[0]
  weights = weights_lib.client_weights(num_samples, m, mask,
                                       numerics.weight_dtype(params))
  return average(params, weights, mask)


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
