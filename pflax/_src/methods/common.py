"""What several methods share: pflax's layer selectors, helpers of `init`, the
loss of a global/personal pair."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from pflax._src.core import tree as tree_lib
from pflax._src.core import types
from pflax._src.methods import algorithm as alg
from pflax._src.training import losses
from pflax._src.training import parts as parts_lib
from pflax._src.training import train


OUTPUT_LAYER = parts_lib.PFLAX_OUTPUT
"""The output layer (kernel and bias) of pflax's models."""
CLASSIFIER = parts_lib.PFLAX_CLASSIFIER
"""Every Dense layer after the feature extractor of pflax's models."""


def first(stacked: types.Stacked) -> types.Tree:
  """Client 0's tree: the common initial model."""
  return jax.tree.map(lambda x: x[0], stacked)


def broadcast_global(global_model: types.Tree,
                     num_samples: chex.Array) -> types.Stacked:
  """Every client's copy of the global model, one per entry of the `(M,)`
  `num_samples` (the states of the methods with a global model hold both)."""
  return tree_lib.broadcast(global_model, num_samples.shape[0])


def sample_counts(class_counts: chex.Array) -> chex.Array:
  """`(M,)` training-set sizes `n_i = sum_j n_ij`."""
  return jnp.sum(class_counts, axis=-1)


def proximal_pair_loss(model: nn.Module, lam: float) -> train.LossFn:
  """The local objective of a pair `{"w", "v"}` trained on the same batches:
  `CE(w) + CE(v) + lam/2 ||v - received||^2`, `received` the client context
  (FedDWA's exclusive model, Ditto's global model)."""
  ce = alg.cross_entropy_loss(model)

  def loss(pair, received, batch, key):
    return (ce(pair["w"], None, batch, key) + ce(pair["v"], None, batch, key)
            + lam * losses.proximal(pair["v"], received))
  return loss
