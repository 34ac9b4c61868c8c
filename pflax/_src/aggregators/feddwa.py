"""FedDWA: exclusive models mixed by a softmax over cosine similarities of updates.

`feddwa` checks its inputs on the host, then runs one module-level jitted
program (alpha and temperature traced), so eager calls are fast after the first.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np

from pflax._src.core import checks
from pflax._src.core import tree as tree_lib
from pflax._src.core import types
from pflax._src.core import weights as weights_lib


def mixing_weights(similarity: chex.Array, alpha: chex.Numeric,
                   temperature: chex.Numeric,
                   mask: chex.Array | None = None) -> chex.Array:
  """Row-stochastic `(M, M)` FedDWA weights (Eq. 4-6, settled in docs/methods.md#feddwa).

  `beta_ij = (1 - alpha) exp(s_ij / T) / sum_{k != i} exp(s_ik / T)` for peers
  `j != i`, and `alpha` on the diagonal. A client without peers (M = 1, or every
  other client masked) keeps itself with weight 1. Masked-out clients are never
  peers; their own rows are irrelevant (callers keep them unchanged).

  The exponent is `(s_ij - max_{k peer} s_ik) / T <= 0`, shifted by the largest
  similarity among the client's peers only, so the most similar peer has
  `exp(0) = 1` at any temperature: no underflow to a self weight of 1, and no
  overflow of `s / T` for a tiny `T`.
  """
  m = similarity.shape[0]
  peer = ~jnp.eye(m, dtype=bool)
  if mask is not None:
    peer = peer & mask[None, :]
  top = jnp.max(jnp.where(peer, similarity, -jnp.inf), axis=1, keepdims=True)
  top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
  expo = jnp.where(peer, jnp.exp(jnp.where(peer, similarity - top, 0.0) / temperature),
                   0.0)
  total = jnp.sum(expo, axis=1, keepdims=True)
  has_peer = total > 0
  softmax = expo / jnp.where(has_peer, total, 1.0)
  self_weight = jnp.where(has_peer[:, 0], alpha, 1.0)
  return (1.0 - alpha) * softmax + jnp.diag(self_weight)


def update_similarity(params: types.Stacked, received: types.Stacked) -> chex.Array:
  """Cosines `s_ij = cos(d_i, d_j)` of the updates `d_i = w_i - w_{g,i}` (Eq. 3).

  The Gram matrix is scaled per client by a power of two (`tree.scaled_gram`),
  so every nonzero update gets its cosine, whatever its magnitude (no norm
  threshold: only an exactly zero update has cosine 0), and the difference is
  taken in float32 (float64 for float64 leaves), so float16 updates cannot
  overflow.
  """
  g, exponents = tree_lib.scaled_gram(params, received)
  return tree_lib.cosine_from_gram(g, 0.0, exponents)


@jax.jit
def _feddwa(params: types.Stacked, received: types.Stacked, alpha: chex.Numeric,
            temperature: chex.Numeric, mask: chex.Array | None) -> types.Stacked:
  safe = weights_lib.zero_masked(params, mask)
  similarity = update_similarity(safe, weights_lib.zero_masked(received, mask))
  beta = mixing_weights(similarity, alpha, temperature, mask)
  mixed = jax.tree.map(lambda x: tree_lib.mix_leaf(beta, x), safe)
  return weights_lib.keep_masked(mixed, params, mask)


def _check_received_finite(received: types.Stacked, mask: chex.Array | None) -> None:
  """Raises if a concrete `received` is non-finite for a client that is not masked."""
  leaves = jax.tree.leaves(received)
  if not all(checks.is_concrete(x) for x in leaves + [mask]):
    return
  with jax.ensure_compile_time_eval():  # concrete even inside a caller's trace
    bad = ~np.asarray(tree_lib.finite_clients(received))
  if mask is not None:
    bad &= np.asarray(mask)
  if bad.any():
    raise ValueError(
        f"received: clients {np.flatnonzero(bad).tolist()} have non-finite entries "
        "but are not masked; their updates would silently get cosine 0. Mask them "
        "out (see pflax.tree.finite_clients).")


def feddwa(params: types.Stacked, received: types.Stacked, *,
           alpha: chex.Numeric = 0.2, temperature: chex.Numeric = 1.0,
           mask: chex.Array | None = None) -> types.Stacked:
  """FedDWA exclusive models `w_{g,i}^{t+1} = alpha w_i^t + sum_{j!=i} beta_ij w_j^t`.

  Args:
    params: stacked models after local training, `w_i^t` (M >= 1, real
      floating leaves; a list of unstacked trees is an error: use
      `pflax.tree.stack`).
    received: stacked exclusive models the clients started from, `w_{g,i}^t`;
      finite for every unmasked client.
    alpha: self weight in [0, 1] (paper: 0.2).
    temperature: softmax temperature `T > 0` over similarities (paper: 1).
    mask: optional bool `(M,)` (array or list); False clients are not peers of
      anyone and keep their parameters unchanged.

  Returns:
    Stacked exclusive models for the next round (mixes of the trained models,
    not of the updates). With M = 1 the output equals the input.

  Raises:
    ValueError: if a concrete `received` has a non-finite entry for an unmasked
      client (a check that reads `received` once more).

  Notes:
    [settled] The peers' weights are a softmax over `k != i` scaled by
    `1 - alpha`, so each row sums to 1 (Eq. 6); the paper's Eq. 4 softmax over
    all k cannot satisfy Eq. 6 with a fixed alpha. Cosines involving an
    exactly zero update are 0; so are, under `jit` (where the check above
    cannot run), those of an unmasked client with a non-finite `received`.
    Cosines come from a per-client power-of-two scaled Gram matrix, so any
    nonzero update, from 1e-30 to 1e30, gets its exact cosine, and the softmax
    is shifted by each client's most similar peer, so it is exact at any
    temperature.

  References:
    FedDWA (Electronics 2025), Sec. 4.2, Eq. (3)-(6) and Algorithm 2.
  """
  _, mask = checks.client_params(params, mask)
  checks.same_structure(params, received, "params", "received")
  checks.float_leaves(received, "received")
  checks.check_range("alpha", alpha, 0.0, 1.0)
  checks.check_range("temperature", temperature, 0.0, None, open_low=True)
  _check_received_finite(received, mask)
  return _feddwa(params, received, alpha, temperature, mask)
