"""FedAvg and FedClassAvg: one weighted mean of the clients, global or per layer."""

import chex
import jax

from pflax._src import checks
from pflax._src import tree as tree_lib
from pflax._src import types
from pflax._src import weights as weights_lib


def check_params(params: types.Stacked, mask: chex.Array | None,
                 name: str = "params") -> int:
  """Boundary checks shared by every aggregator; returns M."""
  m = checks.num_clients(params, name)
  checks.float_leaves(params, name)
  checks.mask(mask, m)
  return m


def fedavg(params: types.Stacked, num_samples: chex.Array | None = None, *,
           mask: chex.Array | None = None) -> types.Tree:
  """Federated averaging: `w = sum_i p_i w_i` with `p_i = n_i / sum_l n_l`.

  Args:
    params: stacked client parameters, leaves `(M, ...)`.
    num_samples: optional `(M,)` non-negative sample counts `n_i`; uniform if None.
    mask: optional bool `(M,)`; False clients contribute nothing (their
      parameters may even be non-finite).

  Returns:
    The global model: a tree without the client axis, in the input dtypes.

  Example:
    >>> params = {"w": jnp.array([[0.0, 2.0], [4.0, 6.0]])}
    >>> fedavg(params, jnp.array([3, 1]))["w"]
    Array([1., 3.], dtype=float32)

  References:
    McMahan et al., "Communication-Efficient Learning of Deep Networks from
    Decentralized Data", AISTATS 2017; cwFedAvg paper Eq. (1).
  """
  m = check_params(params, mask)
  weights_lib.check_client_vector(num_samples, m, "num_samples")
  row = weights_lib.client_weights(num_samples, m, mask)[None]
  safe = weights_lib.zero_masked(params, mask)
  return jax.tree.map(lambda x: tree_lib.mix_leaf(row, x)[0], safe)


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
    params: stacked client parameters.
    num_samples: optional `(M,)` sample counts (uniform if None).
    where: selector of the classifier leaves (default: every leaf under a module
      named "classifier").
    mask: optional bool `(M,)`; False clients are left unchanged and excluded.

  Returns:
    Stacked parameters of the same structure.

  References:
    Jang et al., "FedClassAvg: Local Representation Learning for Personalized
    Federated Learning on Heterogeneous Neural Networks", ICPP 2022, Eq. (3).
  """
  m = check_params(params, mask)
  weights_lib.check_client_vector(num_samples, m, "num_samples")
  row = weights_lib.client_weights(num_samples, m, mask)[None]
  safe = weights_lib.zero_masked(params, mask)
  averaged = tree_lib.map_selected(
      lambda x: tree_lib.broadcast_leaf(tree_lib.mix_leaf(row, x)[0], m),
      lambda x: x, safe, tree_lib.selection(params, where))
  return weights_lib.keep_masked(averaged, params, mask)
