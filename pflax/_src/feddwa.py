"""FedDWA: exclusive models mixed by a softmax over cosine similarities of updates."""

import chex
import jax
import jax.numpy as jnp

from pflax._src import checks
from pflax._src import fedavg as fedavg_lib
from pflax._src import tree as tree_lib
from pflax._src import types
from pflax._src import weights as weights_lib


def mixing_weights(similarity: chex.Array, alpha: chex.Numeric,
                   temperature: chex.Numeric,
                   mask: chex.Array | None = None) -> chex.Array:
  """Row-stochastic `(M, M)` FedDWA weights (Eq. 4-6 as settled in the SPEC).

  `beta_ij = (1 - alpha) exp(s_ij / T) / sum_{k != i} exp(s_ik / T)` for peers
  `j != i`, and `alpha` on the diagonal. A client without peers (M = 1, or every
  other client masked) keeps itself with weight 1. Masked-out clients are never
  peers; their own rows are irrelevant (callers keep them unchanged).
  """
  m = similarity.shape[0]
  peer = ~jnp.eye(m, dtype=bool)
  if mask is not None:
    peer = peer & mask[None, :]
  logits = jnp.where(peer, similarity / temperature, -jnp.inf)
  top = jnp.max(jnp.where(peer, logits, 0.0), axis=1, keepdims=True)
  expo = jnp.where(peer, jnp.exp(logits - top), 0.0)
  total = jnp.sum(expo, axis=1, keepdims=True)
  has_peer = total > 0
  softmax = expo / jnp.where(has_peer, total, 1.0)
  self_weight = jnp.where(has_peer[:, 0], alpha, 1.0)
  return (1.0 - alpha) * softmax + jnp.diag(self_weight)


def update_similarity(params: types.Stacked, received: types.Stacked) -> chex.Array:
  """Cosines `s_ij = cos(d_i, d_j)` of the updates `d_i = w_i - w_{g,i}` (Eq. 3)."""
  return tree_lib.cosine_from_gram(tree_lib.gram(params, received))


def feddwa(params: types.Stacked, received: types.Stacked, *,
           alpha: chex.Numeric = 0.2, temperature: chex.Numeric = 1.0,
           mask: chex.Array | None = None) -> types.Stacked:
  """FedDWA exclusive models `w_{g,i}^{t+1} = alpha w_i^t + sum_{j!=i} beta_ij w_j^t`.

  Args:
    params: stacked models after local training, `w_i^t`.
    received: stacked exclusive models the clients started from, `w_{g,i}^t`.
    alpha: self weight in [0, 1] (paper: 0.2).
    temperature: softmax temperature `T > 0` over similarities (paper: 1).
    mask: optional bool `(M,)`; False clients are not peers of anyone and keep
      their parameters unchanged.

  Returns:
    Stacked exclusive models for the next round (mixes of the trained models,
    not of the updates). With M = 1 the output equals the input.

  Notes:
    [settled] The peers' weights are a softmax over `k != i` scaled by
    `1 - alpha`, so each row sums to 1 (Eq. 6); the paper's Eq. 4 softmax over
    all k cannot satisfy Eq. 6 with a fixed alpha. Cosines involving a zero
    update are 0.

  References:
    FedDWA (Electronics 2025), Sec. 4.2, Eq. (3)-(6) and Algorithm 2.
  """
  fedavg_lib.check_params(params, mask)
  checks.same_structure(params, received, "params", "received")
  checks.float_leaves(received, "received")
  checks.in_range(alpha, "alpha", 0.0, 1.0)
  checks.in_range(temperature, "temperature", 0.0, None, low_open=True)
  safe = weights_lib.zero_masked(params, mask)
  similarity = update_similarity(safe, weights_lib.zero_masked(received, mask))
  beta = mixing_weights(similarity, alpha, temperature, mask)
  mixed = jax.tree.map(lambda x: tree_lib.mix_leaf(beta, x), safe)
  return weights_lib.keep_masked(mixed, params, mask)
