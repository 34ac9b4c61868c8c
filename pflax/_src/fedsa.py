"""FedSA: parameter-skew-aware aggregation with Micro- and Macro-Classes.

Per leaf `W (M, n)`: positions with a low coefficient of variation are averaged;
high-dispersion positions are binned into Micro-Classes (MIC), clients are
clustered into Macro-Classes (MAC) by how often their bins agree, and each
position takes a vote-weighted mean of the clusters' mean parameters.
"""

import chex
import jax
import jax.numpy as jnp

from pflax._src import checks
from pflax._src import fedavg as fedavg_lib
from pflax._src import tree as tree_lib
from pflax._src import types
from pflax._src import weights as weights_lib

_CV_EPS = 1e-12
_HIGHEST = jax.lax.Precision.HIGHEST


def high_dispersion(w: chex.Array, valid: chex.Array, cv_threshold: chex.Numeric,
                    ddof: int) -> chex.Array:
  """Bool `(n,)`: `cv_j = sigma_j / (|mu_j| + 1e-12) > tau` (Eq. 2-6)."""
  weight = valid.astype(w.dtype)
  count = jnp.sum(weight)
  mean = jnp.matmul(weight, w, precision=_HIGHEST) / count
  var = jnp.matmul(weight, jnp.square(w - mean), precision=_HIGHEST) / (count - ddof)
  cv = jnp.sqrt(var) / (jnp.abs(mean) + _CV_EPS)
  return jnp.nan_to_num(cv, nan=-1.0, posinf=-1.0) > cv_threshold


def micro_classes(w: chex.Array, valid: chex.Array, num_mic: int) -> chex.Array:
  """int32 `(M, n)` MIC category of every entry: equal-width bins (Eq. 8-9)."""
  lo = jnp.min(jnp.where(valid[:, None], w, jnp.inf), axis=0)
  hi = jnp.max(jnp.where(valid[:, None], w, -jnp.inf), axis=0)
  width = (hi - lo) / num_mic
  spread = width > 0
  raw = jnp.floor((w - lo) / jnp.where(spread, width, 1.0))
  return jnp.where(spread, jnp.clip(raw, 0, num_mic - 1), 0).astype(jnp.int32)


def category_agreement(categories: chex.Array, high: chex.Array,
                       num_mic: int) -> chex.Array:
  """`(M, M)` `s_ab` = fraction of high positions where bins agree (Eq. 10)."""
  total = jnp.zeros((categories.shape[0],) * 2, jnp.float32)
  for v in range(num_mic):
    e = ((categories == v) & high).astype(jnp.float32)
    total = total + jnp.matmul(e, e.T, precision=_HIGHEST)
  return total / jnp.maximum(jnp.sum(high), 1)


def _membership(member: chex.Array, num_mac: int) -> chex.Array:
  """float32 `(num_mac, M)` one-hot cluster membership."""
  return (member[None, :] == jnp.arange(num_mac)[:, None]).astype(jnp.float32)


def _cluster_similarity(member: chex.Array, similarity: chex.Array,
                        num_mac: int) -> chex.Array:
  """`(num_mac, M)` average-linkage similarity of each cluster to each client."""
  onehot = _membership(member, num_mac)
  sizes = jnp.sum(onehot, axis=1, keepdims=True)
  return jnp.matmul(onehot, similarity, precision=_HIGHEST) / jnp.maximum(sizes, 1.0)


def _first_argmax_2d(score: chex.Array) -> tuple[chex.Array, chex.Array]:
  """Row and column of the first maximum in row-major order."""
  flat = jnp.argmax(score.reshape(-1))
  return flat // score.shape[1], flat % score.shape[1]


def _clustering_step(member: chex.Array, count: chex.Array, similarity: chex.Array,
                     valid: chex.Array, num_mac: int
                     ) -> tuple[chex.Array, chex.Array]:
  """One greedy MAC step: join the best cluster or open one from the best pair."""
  m = member.shape[0]
  free = valid & (member < 0)
  pair_ok = free[:, None] & free[None, :] & jnp.triu(jnp.ones((m, m), bool), k=1)
  pair_score = jnp.where(pair_ok, similarity, -jnp.inf)
  a, b = _first_argmax_2d(pair_score)
  exists = jnp.arange(num_mac) < count
  join_ok = exists[:, None] & free[None, :]
  join_score = jnp.where(join_ok, _cluster_similarity(member, similarity, num_mac),
                         -jnp.inf)
  g, c = _first_argmax_2d(join_score)
  has_pair, has_join = jnp.any(pair_ok), jnp.any(join_ok)
  active = (count < num_mac) & (has_pair | has_join)
  join = has_join & (~has_pair | (join_score[g, c] >= pair_score[a, b]))
  joined = member.at[c].set(g)
  paired = member.at[a].set(count).at[b].set(count)
  new_member = jnp.where(join, joined, paired)
  new_count = jnp.where(join, count, count + 1)
  return jnp.where(active, new_member, member), jnp.where(active, new_count, count)


def macro_classes(similarity: chex.Array, valid: chex.Array, num_mac: int,
                  sim_threshold: chex.Numeric) -> chex.Array:
  """int32 `(M,)` MAC cluster of each client, -1 for unclustered (Sec. 3, MAC).

  Greedy average-linkage clustering: while fewer than `num_mac` clusters exist
  and clients are left, the best unassigned client joins its best cluster if
  that beats the best unassigned pair (`q* >= p*`), else the best pair opens a
  new cluster (ties: lowest indices). Then each remaining client joins its most
  similar (frozen) cluster if the similarity exceeds `sim_threshold`.
  """
  m = similarity.shape[0]
  member = jnp.full((m,), -1, jnp.int32)
  member, count = jax.lax.fori_loop(
      0, max(m - 1, 0),
      lambda _, carry: _clustering_step(*carry, similarity, valid, num_mac),
      (member, jnp.zeros((), jnp.int32)))
  exists = jnp.arange(num_mac) < count
  linkage = jnp.where(exists[:, None], _cluster_similarity(member, similarity, num_mac),
                      -jnp.inf)
  best = jnp.argmax(linkage, axis=0).astype(jnp.int32)
  late = valid & (member < 0) & (jnp.max(linkage, axis=0) > sim_threshold)
  return jnp.where(late, best, member)


def _cluster_vote(w: chex.Array, categories: chex.Array, member: chex.Array,
                  num_mic: int, num_mac: int) -> chex.Array:
  """`theta_j = sum_g alpha_gj P_gj` over clusters (Eq. 11-15)."""
  onehot = _membership(member, num_mac)
  sizes = jnp.sum(onehot, axis=1)
  exists = sizes > 0
  means = jnp.matmul(onehot, w, precision=_HIGHEST) / jnp.maximum(sizes, 1.0)[:, None]
  votes = jnp.stack([jnp.matmul(onehot, (categories == v).astype(jnp.float32),
                                precision=_HIGHEST) for v in range(num_mic)])
  mode = jnp.argmax(votes, axis=0)
  same = (mode[:, None, :] == mode[None, :, :]) & exists[None, :, None]
  support = jnp.sum(same, axis=1) * exists[:, None]
  alpha = support / jnp.maximum(jnp.sum(support, axis=0, keepdims=True), 1)
  return jnp.sum(alpha * means, axis=0)


def _fedsa_leaf(leaf: chex.Array, client: chex.Array, valid: chex.Array,
                cv_threshold: chex.Numeric, num_mic: int, num_mac: int,
                sim_threshold: chex.Numeric, ddof: int) -> chex.Array:
  """FedSA on one stacked leaf; returns the aggregated leaf without client axis."""
  w = leaf.reshape(leaf.shape[0], -1).astype(tree_lib.accumulation_dtype(leaf.dtype))
  average = jnp.matmul(client, w, precision=_HIGHEST)
  high = high_dispersion(w, valid, cv_threshold, ddof)
  categories = micro_classes(w, valid, num_mic)
  similarity = category_agreement(categories, high, num_mic)
  member = macro_classes(similarity, valid, num_mac, sim_threshold)
  clustered = jnp.any(member >= 0)
  theta = _cluster_vote(w, categories, member, num_mic, num_mac)
  out = jnp.where(high & clustered, theta, average)
  return out.reshape(leaf.shape[1:]).astype(leaf.dtype)


def fedsa(params: types.Stacked, num_samples: chex.Array | None = None, *,
          cv_threshold: chex.Numeric = 0.2, num_mic: int = 4, num_mac: int = 4,
          sim_threshold: chex.Numeric = 0.2, ddof: int = 1,
          mask: chex.Array | None = None) -> types.Tree:
  """FedSA global model, applied independently to every leaf.

  Inside a leaf, `W` is `(M, n)` and statistics are per position j over clients:

  1. `cv_j = sigma_j / (|mu_j| + 1e-12)` (std with `ddof`); high-dispersion set
     `H = {j : cv_j > tau}`, low set `L` the rest (Eq. 2-6).
  2. Low positions: FedAvg (`n_k` weights if given, else uniform) (Eq. 7).
  3. MIC: `c_kj = min(num_mic - 1, floor((W_kj - lo_j) / ((hi_j - lo_j) / num_mic)))`
     with `lo_j, hi_j` the min and max over clients (Eq. 8-9).
  4. `s_ab` = fraction of positions in H where `c_aj == c_bj` (Eq. 10).
  5. MAC: greedy average-linkage clustering into at most `num_mac` clusters,
     late clients join if more similar than `sim_threshold` (see
     `macro_classes`); unclustered clients count in steps 1-4 only.
  6. Per cluster g: `E_gj` mode of members' categories (ties: smallest),
     `P_gj` unweighted mean of members' parameters (Eq. 11-12).
  7. `alpha_gj = v_gj / sum_h v_hj` with `v_gj = #{h : E_hj == E_gj}`; high
     positions get `theta_j = sum_g alpha_gj P_gj` (Eq. 13-15).

  Args:
    params: stacked client parameters.
    num_samples: optional `(M,)` sample counts for the low-dispersion average.
    cv_threshold: `tau`, threshold on the coefficient of variation (paper: 0.2).
    num_mic: number of MIC bins (>= 2; paper: 4, 5 for 100 classes, 8 for 200).
    num_mac: maximum number of MAC clusters (>= 1; paper: as `num_mic`).
    sim_threshold: similarity above which a late client joins a cluster (0.2).
    ddof: delta degrees of freedom of the standard deviation.
    mask: optional bool `(M,)`; False clients are excluded from every step.

  Returns:
    The global model: a tree without the client axis.

  Notes:
    The paper's equations were lost in its text; this follows the SPEC's
    reconstruction (§2.6) and reproduces its worked examples. Clustering is at
    most `M - 1` masked-argmax steps in a `lax.fori_loop`, so it jits with
    static M.

  References:
    "FedSA: the Key of Parameter Skew in Federated Learning", Sec. 3,
    Eq. (2)-(15) and Algorithm 1.
  """
  m = fedavg_lib.check_params(params, mask)
  weights_lib.check_client_vector(num_samples, m, "num_samples")
  checks.in_range(cv_threshold, "cv_threshold", 0.0, None)
  checks.in_range(sim_threshold, "sim_threshold", None, None)
  checks.integer_at_least(num_mic, "num_mic", 2)
  checks.integer_at_least(num_mac, "num_mac", 1)
  checks.integer_at_least(ddof, "ddof", 0)
  valid = jnp.ones((m,), bool) if mask is None else mask
  client = weights_lib.client_weights(num_samples, m, mask)
  safe = weights_lib.zero_masked(params, mask)
  return jax.tree.map(
      lambda x: _fedsa_leaf(x, client, valid, cv_threshold, num_mic, num_mac,
                            sim_threshold, ddof), safe)
