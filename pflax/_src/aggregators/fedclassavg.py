"""FedClassAvg's server step: the classifier's FedAvg, given to every client.

`fedclassavg` is `fedavg.average` of the selected leaves, broadcast back into
each client's parameters. It checks its inputs on the host, then runs one
module-level jitted program (the resolved selection is a static argument), so
eager calls are as fast as jitted ones after the first; inside a caller's
`jit` it is inlined.
"""

import functools

import chex
import jax

from pflax._src.aggregators import fedavg as fedavg_lib
from pflax._src.core import checks
from pflax._src.core import numerics
from pflax._src.core import tree as tree_lib
from pflax._src.core import types
from pflax._src.core import weights as weights_lib


@functools.partial(jax.jit, static_argnames="flags")
def _fedclassavg(params: types.Stacked, num_samples: chex.Array | None,
                 mask: chex.Array | None, flags: tuple[bool, ...]) -> types.Stacked:
  m = jax.tree.leaves(params)[0].shape[0]
  weights = weights_lib.client_weights(num_samples, m, mask,
                                       numerics.weight_dtype(params))

  def share_classifier(p: types.Stacked) -> types.Stacked:
    classifier, features = tree_lib.partition_flags(p, flags)
    shared = tree_lib.broadcast(fedavg_lib.average(classifier, weights, mask), m)
    return weights_lib.keep_masked(tree_lib.combine(shared, features), p, mask)

  return weights_lib.keep_if_weightless(weights, share_classifier, params)


def fedclassavg(params: types.Stacked, num_samples: chex.Array | None = None, *,
                where: types.Selector = tree_lib.under("classifier"),
                mask: chex.Array | None = None) -> types.Stacked:
  """Classifier averaging: selected leaves become their FedAvg mean in every client.

  `w_C <- sum_k |D_k| / |D| w_{C,k}` (FedClassAvg Eq. 3) for the leaves chosen by
  `where`; every other leaf (the feature extractor) is returned unchanged. The
  mean is `pflax.aggregate.fedavg` of the selected leaves.

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

  Example:
    >>> import jax.numpy as jnp
    >>> params = {"features": jnp.array([[1.0], [2.0]]),
    ...           "classifier": jnp.array([[0.0], [4.0]])}
    >>> out = fedclassavg(params, jnp.array([3, 1]))
    >>> out["classifier"].tolist(), out["features"].tolist()
    ([[1.0], [1.0]], [[1.0], [2.0]])

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
