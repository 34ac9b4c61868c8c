"""Byzantine-robust aggregation rules of the literature: Krum, Multi-Krum, Bulyan,
the geometric median (RFA) and centered clipping.

Each takes stacked client models (leaves `(M, ...)`) and returns one model. The
distance-based rules (Krum, Multi-Krum, Bulyan) compare the clients through
the Gram matrix of their differences to a `reference` (the model they all
started from, by default the coordinate-wise median), computed leaf by leaf
with `pflax.tree`'s scaled Gram: no concatenated copy of the models, and no
overflow for updates of 1e30. Distances between models equal distances between
their updates, so the choice of reference changes only the rounding.

Masked clients take no part (they may be non-finite); an unmasked client with
a non-finite model is infinitely far from every other, so a rule that selects
never selects it while enough finite clients remain. The bound on the number f
of Byzantine clients each rule needs is checked before anything is compiled
whenever the mask is concrete (docs/robustness.md).
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np

from pflax._src.aggregators import robust as robust_lib
from pflax._src.core import checks
from pflax._src.core import tree as tree_lib
from pflax._src.core import types

_BIG = jnp.inf
"""The distance and score of a pair or client that must never be chosen."""


def _participants(params: types.Stacked, mask: chex.Array | None
                  ) -> tuple[int, chex.Array | None, int | None]:
  """`(M, mask, n)`: boundary checks, with n the number of participants when
  it is known before tracing (None under a traced mask)."""
  m, mask = checks.client_params(params, mask)
  checks.some_weight(None, mask)
  if mask is None:
    return m, None, m
  if not checks.is_concrete(mask):
    return m, mask, None
  return m, mask, int(np.sum(np.asarray(mask)))


def _check_byzantine(num_byzantine: int, n: int | None, need: int, rule: str,
                     bound: str) -> None:
  """ValueError unless `n >= need` clients take part (when n is known)."""
  checks.integer_at_least(num_byzantine, "num_byzantine", 0)
  if n is not None and n < need:
    raise ValueError(f"{rule} with num_byzantine f = {num_byzantine} needs {bound} "
                     f"participating clients (at least {need}), got {n}; lower f or "
                     "add clients.")


def _check_model(model: types.Tree, params: types.Stacked, name: str) -> None:
  """ValueError unless `model` is one model of `params`'s structure, each leaf
  of `params`'s shape without the client axis."""
  leaves, structure = jax.tree.flatten(model)
  if structure != jax.tree.structure(params):
    raise ValueError(f"{name} must have the structure of params without the client "
                     f"axis; got {structure}, params has {jax.tree.structure(params)}.")
  for leaf, x in zip(leaves, jax.tree.leaves(params)):
    if np.shape(leaf) != x.shape[1:]:
      raise ValueError(f"{name}: every leaf must have the shape of params' leaf "
                       f"without the client axis, {x.shape[1:]}; got {np.shape(leaf)}.")


def _rows(x: chex.Array, v: chex.Array) -> chex.Array:
  """`v (M,)` shaped to broadcast against the leaf `x (M, ...)`."""
  return v.reshape((-1,) + (1,) * (x.ndim - 1))


def _present(params: types.Stacked, mask: chex.Array | None, fill: types.Tree
             ) -> types.Stacked:
  """`params` with the masked clients replaced by `fill` (so none reads them)."""
  if mask is None:
    return params
  return jax.tree.map(lambda x, f: jnp.where(_rows(x, mask), x, f[None].astype(x.dtype)),
                      params, fill)


def squared_distances(params: types.Stacked, reference: types.Tree) -> chex.Array:
  """float32 `(M, M)`: `||w_i - w_j||^2` over the whole tree.

  From the scaled Gram matrix of `w_i - reference` (`pflax.tree`'s blocked,
  power-of-two scaled Gram), so the differences are never stacked into one
  copy. Pairs whose distance is not finite (a non-finite or overflowing
  client) get +inf; the diagonal is 0.
  """
  offset = jax.tree.map(lambda r, x: jnp.broadcast_to(r[None], x.shape).astype(x.dtype),
                        reference, params)
  g, e = tree_lib.scaled_gram(params, offset)
  g, s = g.astype(jnp.float32), jnp.exp2(e.astype(jnp.float32))
  sq = jnp.diagonal(g) * s * s
  d = sq[:, None] + sq[None, :] - 2.0 * g * s[:, None] * s[None, :]
  d = jnp.where(jnp.isnan(d), _BIG, jnp.maximum(d, 0.0))
  d = 0.5 * d + 0.5 * d.T  # exactly symmetric, so equal pairs tie exactly
  return jnp.where(jnp.eye(d.shape[0], dtype=bool), 0.0, d)


def krum_scores(distances: chex.Array, num_byzantine: int,
                candidates: chex.Array) -> chex.Array:
  """float32 `(M,)`: Krum's score of each candidate (Blanchard et al. 2017, Eq. 2).

  `s(i) = sum_{i -> j} ||V_i - V_j||^2` over the `n - f - 2` candidates j != i
  closest to i, n the number of candidates (at least one neighbour is kept, so
  that scores stay informative in Bulyan's last selections). Non-candidates
  score +inf.
  """
  n = jnp.sum(candidates)
  others = candidates[None, :] & ~jnp.eye(candidates.shape[0], dtype=bool)
  nearest = jnp.sort(jnp.where(others, distances, _BIG), axis=1)
  k = jnp.maximum(n - num_byzantine - 2, 1)
  # Sum of each row's k smallest: the positions past k are masked, not cut,
  # since k may be traced.
  taken = jnp.arange(nearest.shape[1])[None, :] < k
  score = jnp.sum(jnp.where(taken, nearest, 0.0), axis=1)
  return jnp.where(candidates, score, _BIG)


def _best(distances: chex.Array, scores: chex.Array, candidates: chex.Array,
          count: int) -> chex.Array:
  """Bool `(M,)`: the `count` candidates of lowest score.

  Equal scores (two mutual nearest neighbours, in Bulyan's last selections)
  are ordered by the sum of all the candidate's distances, then by index, so
  the choice does not depend on the clients' order for distinct models.
  """
  total = jnp.sum(jnp.where(candidates[None, :], distances, 0.0), axis=1)
  order = jnp.lexsort((total, scores, ~candidates))
  rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
  return candidates & (rank < count)


def _reference(params, mask, reference):
  return robust_lib.median(params, mask=mask) if reference is None else reference


@functools.partial(jax.jit, static_argnames=("num_byzantine", "num_selected"))
def _multi_krum(params, reference, mask, num_byzantine, num_selected):
  m = jax.tree.leaves(params)[0].shape[0]
  candidates = jnp.ones(m, bool) if mask is None else mask
  params = _present(params, mask, reference)
  distances = squared_distances(params, reference)
  scores = krum_scores(distances, num_byzantine, candidates)
  count = (jnp.sum(candidates) - num_byzantine if num_selected is None
           else num_selected)
  chosen = _best(distances, scores, candidates, count)
  weights = chosen.astype(jnp.float32) / jnp.maximum(jnp.sum(chosen), 1)
  return jax.tree.map(
      lambda x: tree_lib.mix_leaf(weights[None], jnp.where(_rows(x, chosen), x, 0))[0],
      params)


def multi_krum(params: types.Stacked, *, num_byzantine: int,
               num_selected: int | None = None,
               reference: types.Tree | None = None,
               mask: chex.Array | None = None) -> types.Tree:
  """Multi-Krum: the mean of the `m` clients of lowest Krum score.

  With n participants of which at most f are Byzantine (n > 2f + 2), each
  client's score is the sum of its squared distances to its `n - f - 2`
  nearest others (`krum_scores`, Blanchard et al. 2017, Eq. 2); the `m` best
  are averaged, unweighted (Section 5, Multi-Krum). `m = 1` is Krum.

  Args:
    params: stacked client models, leaves `(M, ...)`, real floating dtypes.
    num_byzantine: f >= 0, the number of Byzantine clients tolerated.
    num_selected: m in [1, n]; None: n - f (the paper's experiments).
    reference: a tree without the client axis that the distances are taken
      from (e.g. the global model the clients started from); None: the
      coordinate-wise median. It changes only the rounding.
    mask: optional bool `(M,)`; masked clients take no part.

  Returns:
    A tree without the client axis, in the input dtypes.

  Raises:
    ValueError: for `n <= 2f + 2` participants (a concrete mask), m out of
      range, or bad inputs.

  Example:
    >>> import jax.numpy as jnp
    >>> from pflax.aggregate import multi_krum
    >>> w = jnp.array([[0.0], [0.1], [0.2], [0.3], [0.4], [1e3]])
    >>> round(float(multi_krum({"w": w}, num_byzantine=1, num_selected=3)["w"][0]), 4)
    0.2

  References:
    Blanchard, El Mhamdi, Guerraoui, Stainer, "Machine Learning with
    Adversaries: Byzantine Tolerant Gradient Descent", NeurIPS 2017.
  """
  m, mask, n = _participants(params, mask)
  _check_byzantine(num_byzantine, n, 2 * num_byzantine + 3, "Krum", "n > 2f + 2")
  if num_selected is not None:
    checks.integer_at_least(num_selected, "num_selected", 1)
  if num_selected is not None and num_selected > (m if n is None else n):
    raise ValueError(f"num_selected must be at most the {m if n is None else n} "
                     f"participating clients, got {num_selected}.")
  if reference is not None:
    _check_model(reference, params, "reference")
  return _multi_krum(params, _reference(params, mask, reference), mask,
                     num_byzantine=num_byzantine, num_selected=num_selected)


def krum(params: types.Stacked, *, num_byzantine: int,
         reference: types.Tree | None = None,
         mask: chex.Array | None = None) -> types.Tree:
  """Krum: the one client model of lowest Krum score (Blanchard et al. 2017,
  Section 4): `multi_krum` with `num_selected=1`.

  Example:
    >>> import jax.numpy as jnp
    >>> from pflax.aggregate import krum
    >>> w = jnp.array([[0.0], [0.1], [0.3], [0.35], [1e3]])
    >>> krum({"w": w}, num_byzantine=0)["w"]
    Array([0.1], dtype=float32)
  """
  return multi_krum(params, num_byzantine=num_byzantine, num_selected=1,
                    reference=reference, mask=mask)


def _bulyan_selection(distances, candidates, num_byzantine, theta):
  """Bool `(M,)`: Bulyan's set S, `theta` clients chosen one by one by Krum
  on the clients not yet chosen (El Mhamdi et al. 2018, Algorithm 1)."""
  def pick(_, chosen):
    rest = candidates & ~chosen
    best = _best(distances, krum_scores(distances, num_byzantine, rest), rest, 1)
    return chosen | best
  return jax.lax.fori_loop(0, theta, pick, jnp.zeros_like(candidates))


def _closest_to_median_mean(x, chosen, beta):
  """Per coordinate, the mean of the `beta` values of the `chosen` clients
  closest to their median (ties: lowest index)."""
  s = jnp.where(_rows(x, chosen), x.astype(jnp.float32), jnp.inf)
  ordered = jnp.sort(s, axis=0)
  k = jnp.sum(chosen)
  last = x.shape[0] - 1
  take = lambda i: jax.lax.dynamic_index_in_dim(ordered, jnp.clip(i, 0, last), 0,
                                                keepdims=False)
  middle = 0.5 * take((k - 1) // 2) + 0.5 * take(k // 2)
  gap = jnp.where(_rows(x, chosen), jnp.abs(s - middle[None]), jnp.inf)
  order = jnp.argsort(gap, axis=0, stable=True)
  nearest = jnp.take_along_axis(s, order, axis=0)
  rank = jnp.arange(x.shape[0]).reshape((-1,) + (1,) * (x.ndim - 1))
  total = jnp.sum(jnp.where(rank < beta, nearest, 0.0), axis=0)
  return (total / jnp.maximum(beta, 1)).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("num_byzantine",))
def _bulyan(params, reference, mask, num_byzantine):
  m = jax.tree.leaves(params)[0].shape[0]
  candidates = jnp.ones(m, bool) if mask is None else mask
  params = _present(params, mask, reference)
  n = jnp.sum(candidates)
  theta = jnp.maximum(n - 2 * num_byzantine, 1)
  beta = jnp.maximum(theta - 2 * num_byzantine, 1)
  distances = squared_distances(params, reference)
  chosen = _bulyan_selection(distances, candidates, num_byzantine, theta)
  return jax.tree.map(lambda x: _closest_to_median_mean(x, chosen, beta), params)


def bulyan(params: types.Stacked, *, num_byzantine: int,
           reference: types.Tree | None = None,
           mask: chex.Array | None = None) -> types.Tree:
  """Bulyan over Krum (El Mhamdi et al. 2018, Algorithm 1).

  With n >= 4f + 3 participants: (1) theta = n - 2f clients are selected one
  at a time, each the Krum choice (`krum_scores`) among those not yet
  selected; (2) per coordinate, the beta = theta - 2f selected values closest
  to their median are averaged.

  Args:
    params: stacked client models, leaves `(M, ...)`, real floating dtypes.
    num_byzantine: f >= 0.
    reference: as in `multi_krum`.
    mask: optional bool `(M,)`; masked clients take no part.

  Returns:
    A tree without the client axis, in the input dtypes.

  Raises:
    ValueError: for `n < 4f + 3` participants (a concrete mask).

  Example:
    >>> import jax.numpy as jnp
    >>> from pflax.aggregate import bulyan
    >>> w = jnp.array([[0.0], [0.1], [0.2], [0.3], [0.4], [0.5], [1e3]])
    >>> round(float(bulyan({"w": w}, num_byzantine=1)["w"][0]), 4)
    0.3

  References:
    El Mhamdi, Guerraoui, Rouault, "The Hidden Vulnerability of Distributed
    Learning in Byzantium", ICML 2018.
  """
  _, mask, n = _participants(params, mask)
  _check_byzantine(num_byzantine, n, 4 * num_byzantine + 3, "Bulyan", "n >= 4f + 3")
  if reference is not None:
    _check_model(reference, params, "reference")
  return _bulyan(params, _reference(params, mask, reference), mask,
                 num_byzantine=num_byzantine)


def _distances_to(params: types.Stacked, v: types.Tree) -> chex.Array:
  """float32 `(M,)`: `||w_i - v||` over the whole tree (+inf if not finite)."""
  sq = sum(jnp.sum(jnp.square(jnp.asarray(x, jnp.float32) - jnp.asarray(c, jnp.float32)[None])
                   .reshape(x.shape[0], -1), axis=1)
           for x, c in zip(jax.tree.leaves(params), jax.tree.leaves(v)))
  return jnp.where(jnp.isfinite(sq), jnp.sqrt(sq), _BIG)


def _weighted(params: types.Stacked, weights: chex.Array) -> types.Tree:
  """`sum_i weights_i w_i` in float32, input dtypes out."""
  return jax.tree.map(lambda x: tree_lib.mix_leaf(weights[None], x)[0], params)


@functools.partial(jax.jit, static_argnames=("iterations",))
def _geometric_median(params, alphas, smoothing, iterations):
  alphas = alphas / jnp.sum(alphas)
  present = alphas > 0
  params = jax.tree.map(lambda x: jnp.where(_rows(x, present), x, 0), params)

  def step(_, v):
    beta = alphas / jnp.maximum(smoothing, _distances_to(params, v))
    return _weighted(params, beta / jnp.sum(beta))
  return jax.lax.fori_loop(0, iterations, step, _weighted(params, alphas))


def geometric_median(params: types.Stacked, num_samples: chex.Array | None = None, *,
                     smoothing: float = 1e-6, iterations: int = 3,
                     mask: chex.Array | None = None) -> types.Tree:
  """The weighted geometric median by the smoothed Weiszfeld algorithm (RFA).

  Minimises `sum_i alpha_i max(nu, ||v - w_i||)` (Pillutla et al. 2022,
  Eq. 5) from the weighted mean `v_0`: each iteration sets
  `beta_i = alpha_i / max(nu, ||v - w_i||)` and `v = sum_i beta_i w_i /
  sum_i beta_i` (Algorithm 2). `alpha_i` are the normalised sample counts.

  Args:
    params: stacked client models, leaves `(M, ...)`, real floating dtypes.
    num_samples: optional `(M,)` non-negative counts (uniform if None).
    smoothing: nu > 0 (the paper's 1e-6).
    iterations: Weiszfeld iterations R >= 0 (the paper finds 3 enough; 0
      gives the weighted mean).
    mask: optional bool `(M,)`; masked clients take no part.

  Returns:
    A tree without the client axis, in the input dtypes.

  Example:
    >>> import jax.numpy as jnp
    >>> from pflax.aggregate import geometric_median
    >>> w = jnp.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1e3, 1e3]])
    >>> geometric_median({"w": w}, iterations=100)["w"].round(4)  # not pulled to 1e3
    Array([0.5, 0.5], dtype=float32)

  References:
    Pillutla, Kakade, Harchaoui, "Robust Aggregation for Federated Learning",
    IEEE Transactions on Signal Processing 70, 2022.
  """
  m, mask, _ = _participants(params, mask)
  checks.check_range("smoothing", smoothing, 0.0, open_low=True)
  checks.integer_at_least(iterations, "iterations", 0)
  alphas = jnp.ones((m,), jnp.float32)
  if num_samples is not None:
    checks.shape(num_samples, "num_samples", (m,), "(M,)")
    checks.non_negative_finite(num_samples, "num_samples")
    checks.some_weight(num_samples, mask)
    alphas = jnp.asarray(num_samples, jnp.float32)
  if mask is not None:
    alphas = jnp.where(mask, alphas, 0.0)
  return _geometric_median(params, alphas, jnp.asarray(smoothing, jnp.float32),
                           iterations=iterations)


@functools.partial(jax.jit, static_argnames=("iterations",))
def _centered_clipping(params, center, radius, mask, iterations):
  m = jax.tree.leaves(params)[0].shape[0]
  present = jnp.ones(m, bool) if mask is None else mask
  params = _present(params, mask, center)
  share = present.astype(jnp.float32) / jnp.maximum(jnp.sum(present), 1)

  def step(_, v):
    norms = _distances_to(params, v)
    scale = share * jnp.minimum(1.0, radius / jnp.maximum(norms, 1e-30))
    scale = jnp.where(present & jnp.isfinite(norms), scale, 0.0)
    return jax.tree.map(
        lambda x, c: (jnp.asarray(c, jnp.float32) + tree_lib.mix_leaf(
            scale[None], jnp.asarray(x, jnp.float32)
            - jnp.asarray(c, jnp.float32)[None])[0]).astype(c.dtype),
        params, v)
  center = jax.tree.map(lambda c, x: jnp.asarray(c, x.dtype), center, params)
  return jax.lax.fori_loop(0, iterations, step, center)


def centered_clipping(params: types.Stacked, center: types.Tree, *, radius: float,
                      iterations: int = 1,
                      mask: chex.Array | None = None) -> types.Tree:
  """Centered clipping (Karimireddy, He, Jaggi 2021, Eq. 4 / Algorithm 2).

  From `v_0 = center` (the previous aggregate: in pflax's methods the global
  model the clients started from), `L` iterations of
  `v <- v + (1/n) sum_i (w_i - v) min(1, tau / ||w_i - v||)`, unweighted over
  the n participants. With `tau = inf` one iteration is the mean.

  Args:
    params: stacked client models, leaves `(M, ...)`, real floating dtypes.
    center: `v_0`, a tree without the client axis.
    radius: tau > 0 (may be `float("inf")`).
    iterations: L >= 1 (the paper finds one enough).
    mask: optional bool `(M,)`; masked clients take no part.

  Returns:
    A tree without the client axis, in the input dtypes.

  Example:
    >>> import jax.numpy as jnp
    >>> from pflax.aggregate import centered_clipping
    >>> w = jnp.array([[1.0], [1.0], [1.0], [1e6]])
    >>> centered_clipping({"w": w}, {"w": jnp.zeros(1)}, radius=2.0)["w"]
    Array([1.25], dtype=float32)

  References:
    Karimireddy, He, Jaggi, "Learning from History for Byzantine Robust
    Optimization", ICML 2021.
  """
  _, mask, _ = _participants(params, mask)
  _check_model(center, params, "center")
  if checks.is_concrete(radius) and not (np.ndim(radius) == 0 and radius > 0):
    raise ValueError(f"radius must be a scalar > 0 (inf allowed), got {radius!r}.")
  checks.integer_at_least(iterations, "iterations", 1)
  return _centered_clipping(params, center, jnp.asarray(radius, jnp.float32), mask,
                            iterations=iterations)
