"""Client-level differential privacy: Poisson sampling, clipping, the noised mean.

DP-FedAvg (McMahan et al. 2018, "Learning Differentially Private Recurrent
Language Models", ICLR 2018, Algorithm 1 with the fixed-denominator estimator
f~_f): each round every client takes part independently with probability q;
participant i's update `Delta_i` of the shared parameters is clipped to L2
norm C over all shared leaves jointly, `Delta_i * min(1, C / ||Delta_i||)`;
the server releases

    Delta = (sum_i clip(Delta_i) + N(0, (z C)^2 I)) / (q M),

with the denominator fixed at the expected number of participants `q M`, so
that adding or removing one client moves the noised sum by at most C (the
sensitivity the Gaussian mechanism's analysis needs). The privacy loss of T
such rounds is that of `PoissonSampledDpEvent(q, GaussianDpEvent(z))`
composed T times (`pflax.privacy.epsilon`).

`dp_class_models` is the same mechanism for cwFedAvg's class models (Lee &
Choi, Eq. 6): each participant's class-weighted contributions to all K class
models and its update of the other layers are clipped as one vector.
"""

import chex
import jax
import jax.numpy as jnp

from pflax._src.core import checks
from pflax._src.core import types
from pflax._src.core import weights as weights_lib


def poisson_sample(key: chex.PRNGKey, num_clients: int, rate: float) -> chex.Array:
  """Bool `(num_clients,)`: each client independently True with probability `rate`.

  The sampling that `PoissonSampledDpEvent` analyses (McMahan et al. 2018,
  Algorithm 1: `C^t <- (sample users with probability q)`).

  >>> import jax
  >>> poisson_sample(jax.random.key(0), 4, 1.0).tolist()
  [True, True, True, True]
  """
  return jax.random.uniform(key, (num_clients,)) < rate


def update_norms(updates: types.Stacked) -> chex.Array:
  """`(M,)` each client's L2 norm over all leaves of `updates` jointly."""
  squares = [jnp.sum(jnp.square(x.astype(jnp.float32)).reshape(x.shape[0], -1), axis=1)
             for x in jax.tree.leaves(updates)]
  return jnp.sqrt(sum(squares))


def clip_deltas(updates: types.Stacked, clip_norm: chex.Numeric, *,
                mask: chex.Array | None = None) -> types.Stacked:
  """Each client's update scaled to L2 norm at most `clip_norm`; masked-out rows 0.

  `Delta_i * min(1, C / ||Delta_i||)`, the norm over all leaves jointly
  (McMahan et al. 2018, Algorithm 1, `ClipFn` flat clipping). A non-finite
  update counts as 0 (its client contributes nothing, which keeps the bound).

  Args:
    updates: stacked updates `w_i - w`, leaves `(M, ...)`.
    clip_norm: C > 0 (`jnp.inf`: no clipping).
    mask: optional bool `(M,)`: the clients whose updates count.

  Returns:
    The clipped updates, float32 leaves `(M, ...)`.

  Example:
    >>> import jax.numpy as jnp
    >>> out = clip_deltas({"w": jnp.array([[3.0, 4.0], [0.3, 0.4]])}, 1.0)
    >>> [[round(v, 4) for v in row] for row in out["w"].tolist()]
    [[0.6, 0.8], [0.3, 0.4]]
  """
  _, mask = checks.client_params(updates, mask)
  if checks.is_concrete(clip_norm) and not clip_norm > 0:
    raise ValueError(f"clip_norm must be > 0, got {clip_norm!r}.")
  norms = update_norms(updates)
  finite = jnp.isfinite(norms)
  keep = mask & finite if mask is not None else finite
  scale = jnp.where(keep, jnp.minimum(1.0, clip_norm / jnp.where(norms > 0, norms, 1.0)),
                    0.0)

  def clipped(x):
    x = jnp.where(keep.reshape((-1,) + (1,) * (x.ndim - 1)), x.astype(jnp.float32), 0.0)
    return x * scale.reshape((-1,) + (1,) * (x.ndim - 1))
  return jax.tree.map(clipped, updates)


def noisy_sum(clipped: types.Stacked, key: chex.PRNGKey, clip_norm: chex.Numeric,
              noise_multiplier: chex.Numeric) -> types.Tree:
  """`sum_i Delta_i + N(0, (z C)^2 I)`: the Gaussian mechanism on the sum of
  already clipped updates (one independent normal per coordinate, the leaves
  drawn from `fold_in(key, leaf index)`)."""
  leaves, treedef = jax.tree.flatten(clipped)
  z = jnp.asarray(noise_multiplier, jnp.float32)
  std = jnp.where(z == 0, 0.0, z * clip_norm)   # z = 0 with C = inf: no noise
  noised = [jnp.sum(x, axis=0) + std * jax.random.normal(
      jax.random.fold_in(key, i), x.shape[1:], jnp.float32)
            for i, x in enumerate(leaves)]
  return jax.tree.unflatten(treedef, noised)


def dp_mean(updates: types.Stacked, key: chex.PRNGKey, clip_norm: chex.Numeric,
            noise_multiplier: chex.Numeric, expected_participants: chex.Numeric, *,
            mask: chex.Array | None = None) -> types.Tree:
  """DP-FedAvg's noised mean update, `(sum_i clip(Delta_i) + N(0, (zC)^2 I)) / (qM)`.

  McMahan et al. 2018, Algorithm 1 with the fixed-denominator estimator
  (`f~_f`, weights 1, `W = q M`): with `noise_multiplier` 0 and `clip_norm`
  infinite it is the plain sum of the masked updates over `q M`.

  Args:
    updates: stacked updates `w_i - w`, leaves `(M, ...)`.
    key: the noise's key.
    clip_norm: C > 0.
    noise_multiplier: z >= 0 (the noise's std is z C).
    expected_participants: q M > 0, the fixed denominator.
    mask: optional bool `(M,)`: the round's participants.

  Returns:
    The mean update, float32 leaves without the client axis.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> out = dp_mean({"w": jnp.array([[3.0, 4.0], [0.3, 0.4]])}, jax.random.key(0),
    ...               1.0, 0.0, 2.0)
    >>> [round(v, 2) for v in out["w"].tolist()]
    [0.45, 0.6]
  """
  if checks.is_concrete(noise_multiplier) and not noise_multiplier >= 0:
    raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier!r}.")
  if checks.is_concrete(expected_participants) and not expected_participants > 0:
    raise ValueError("expected_participants (q M) must be > 0, got "
                     f"{expected_participants!r}.")
  total = noisy_sum(clip_deltas(updates, clip_norm, mask=mask), key, clip_norm,
                    noise_multiplier)
  return jax.tree.map(lambda x: x / expected_participants, total)


def class_contributions(layers: types.Stacked, class_models: types.Stacked,
                        class_dist: chex.Array) -> types.Stacked:
  """`c_ij = a_ij (w_i - G_j)`: client i's contribution to class model j, leaves
  `(M, K, ...)` float32, with `a_ij` the rows of `class_dist` normalised to sum 1
  (`weights.row_distribution`; a zero row is uniform)."""
  a = weights_lib.row_distribution(class_dist)

  def leaf(x, g):
    x, g = x.astype(jnp.float32), g.astype(jnp.float32)
    return a.reshape(a.shape + (1,) * (x.ndim - 1)) * (x[:, None] - g[None])
  return jax.tree.map(leaf, layers, class_models)


def dp_class_models(layers: types.Stacked, class_models: types.Stacked,
                    class_dist: chex.Array, key: chex.PRNGKey,
                    clip_norm: chex.Numeric, noise_multiplier: chex.Numeric,
                    expected_participants: chex.Numeric, *,
                    rest: types.Stacked = None,
                    mask: chex.Array | None = None) -> tuple[types.Stacked, types.Tree]:
  """cwFedAvg's class models (Eq. 6) by the Gaussian mechanism, and the noised
  mean update of the other layers.

  Client i sends, clipped to L2 norm C as one vector (`clip_deltas`), its
  contributions to every class model and its update of the other layers,

      v_i = (a_i1 (w_i - G_1), ..., a_iK (w_i - G_K), r_i),

  with `w_i` its trained class-wise layers, `G_j` the current class models,
  `a_ij = p~_ij` its class distribution (rows of `class_dist`, normalised) and
  `r_i = u_i - u` its update of the other layers. Each coordinate of `sum_i
  clip(v_i)` gets `N(0, (z C)^2)` (`noisy_sum`), and

      G_j <- G_j + S_j / (q M / K),    u <- u + S_r / (q M)

  with the fixed denominators of a uniform public class prior: `q M / K` per
  class model, `q M` for the other layers. One client moves the noised sum by
  at most C, so a round is `GaussianDpEvent(z)` as in `dp_mean`; `sum_j
  a_ij^2 <= 1`, so the weighting never makes a client's vector longer than
  its largest `||w_i - G_j||` (clipping binds no sooner than DP-FedAvg's).

  With z = 0, C = inf, every client in `mask` and `sum_i a_ij = q M / K` for
  every class, `G_j' = sum_i a_ij w_i / sum_i a_ij`: Eq. 6 with equal sample
  counts (`pflax.aggregate.class_models(layers, class_dist, ones)`).

  Args:
    layers: the `(M, ...)` trained class-wise layers.
    class_models: the `(K, ...)` current class models, same structure.
    class_dist: `(M, K)` each client's class distribution (Eq. 4's estimate
      `p~_i` from its own kernel, or its empirical one), rows normalised here.
    key: the noise's key.
    clip_norm: C > 0 (`jnp.inf`: no clipping).
    noise_multiplier: z >= 0.
    expected_participants: q M > 0.
    rest: optional `(M, ...)` updates `u_i - u` of the other layers.
    mask: optional bool `(M,)`: the round's participants.

  Returns:
    `(class_models, rest_update)`: the new `(K, ...)` class models (their
    dtypes) and the float32 mean update of `rest` (None without `rest`).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> new, _ = dp_class_models({"w": jnp.array([[1.0], [3.0]])},
    ...                          {"w": jnp.zeros((2, 1))}, jnp.eye(2),
    ...                          jax.random.key(0), jnp.inf, 0.0, 2.0)
    >>> new["w"].ravel().tolist()   # one class per client: its own model
    [1.0, 3.0]

  References:
    Lee & Choi, "Class-Wise Federated Averaging for Efficient
    Personalization", Eq. (4), (6), (7); McMahan et al. 2018, Algorithm 1.
  """
  m, mask = checks.client_params(layers, mask, "layers")
  k = checks.stacked_clients(class_models, "class_models")
  checks.shape(class_dist, "class_dist", (m, k), "(M, K)")
  checks.non_negative_finite(class_dist, "class_dist")
  if checks.is_concrete(noise_multiplier) and not noise_multiplier >= 0:
    raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier!r}.")
  if checks.is_concrete(expected_participants) and not expected_participants > 0:
    raise ValueError("expected_participants (q M) must be > 0, got "
                     f"{expected_participants!r}.")
  vectors = {"class": class_contributions(layers, class_models, class_dist),
             "rest": rest}
  total = noisy_sum(clip_deltas(vectors, clip_norm, mask=mask), key, clip_norm,
                    noise_multiplier)
  new = jax.tree.map(
      lambda g, s: (g.astype(jnp.float32) + s * k / expected_participants).astype(g.dtype),
      class_models, total["class"])
  rest_update = (None if rest is None else
                 jax.tree.map(lambda s: s / expected_participants, total["rest"]))
  return new, rest_update
