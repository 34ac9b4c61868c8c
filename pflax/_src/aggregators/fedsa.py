"""FedSA: parameter-skew-aware aggregation with Micro- and Macro-Classes.

Per leaf `W (M, n)`: positions with a low coefficient of variation are averaged;
high-dispersion positions are binned into Micro-Classes (MIC), clients are
clustered into Macro-Classes (MAC) by how often their bins agree, and each
position takes a vote-weighted mean of the clusters' mean parameters.
"""

import functools
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from pflax._src.aggregators import fedavg as fedavg_lib
from pflax._src.core import checks
from pflax._src.core import numerics
from pflax._src.core import types
from pflax._src.core import weights as weights_lib

_CV_EPS = 1e-12
_HIGHEST = jax.lax.Precision.HIGHEST
# Linkages within this relative distance of `sim_threshold` count as equal to it.
_THRESHOLD_TIE = 2.0 ** -20
_INT32_LIMIT = 2 ** 31


def _count_dot(a: chex.Array, b: chex.Array, b_axis: int = 0) -> chex.Array:
  """Exact int32 product of int8 indicators: `a @ b`, or `a @ b.T` if `b_axis=1`.

  `b_axis` names the contracted axis of `b`, so `a @ b.T` needs no transposed
  copy. On XLA-CPU an int8 dot runs about twice as fast as a float32 one.
  """
  return jax.lax.dot_general(a, b, (((1,), (b_axis,)), ((), ())),
                             preferred_element_type=jnp.int32)


def _masked_range(w: chex.Array, mask: chex.Array) -> tuple[chex.Array, chex.Array]:
  """Per-position min and max over the masked-in clients, one client row at a time.

  A loop over rows: on XLA-CPU a reduction over the leading (client) axis is
  an order of magnitude slower.
  """
  def step(i, bounds):
    lo, hi = bounds
    return (jnp.where(mask[i], jnp.minimum(lo, w[i]), lo),
            jnp.where(mask[i], jnp.maximum(hi, w[i]), hi))
  inf = jnp.full(w.shape[1:], jnp.inf, w.dtype)
  return jax.lax.fori_loop(0, w.shape[0], step, (inf, -inf))


class _Scaled(NamedTuple):
  """A flattened leaf scaled per position by a power of two (see `_scaled`)."""
  w: chex.Array        # (M, n) entries in (-1, 1) (unless beyond the normal range)
  lo: chex.Array       # (n,) scaled min over the masked-in clients
  hi: chex.Array       # (n,) scaled max over the masked-in clients
  scale: chex.Array    # (n,) 2^-e, the factor applied
  unscale: chex.Array  # (n,) 2^e, its exact inverse


def _scaled(w: chex.Array, mask: chex.Array) -> _Scaled:
  """`w * 2^-e_j` with `2^e_j > max_k |W_kj|` over the masked-in clients.

  Multiplying by a power of two is exact, and every statistic of steps 1-3 is
  invariant to a per-position scale (the CV's `eps` is scaled with it), so the
  scaled statistics equal the unscaled ones while no square, sum or
  difference can overflow (FedSA used to call every position of `|W| ~ 1e19`
  low-dispersion: its variance overflowed).
  """
  lo, hi = _masked_range(jax.lax.stop_gradient(w), mask)
  info = jnp.finfo(w.dtype)
  e = jnp.clip(numerics.frexp_exponent(jnp.maximum(jnp.abs(lo), jnp.abs(hi))),
               info.minexp, info.maxexp - 2)
  scale = numerics.power_of_two(-e, w.dtype)
  unscale = numerics.power_of_two(e, w.dtype)
  return _Scaled(w * scale, lo * scale, hi * scale, scale, unscale)


def high_dispersion(x: _Scaled, mask: chex.Array, cv_threshold: chex.Numeric,
                    ddof: int) -> chex.Array:
  """Bool `(n,)`: `cv_j = sigma_j / (|mu_j| + 1e-12) > tau` (Eq. 2-6).

  Tested as `sigma_j > tau (|mu_j| + 1e-12)` on the scaled leaf: no division,
  and `cv_j` exactly `tau` is low dispersion. A position with `M - ddof <= 0`
  masked-in clients is low dispersion.
  """
  weight = mask.astype(x.w.dtype)
  count = jnp.sum(weight)
  mean = jnp.matmul(weight, x.w, precision=_HIGHEST) / jnp.maximum(count, 1.0)
  squares = jax.lax.fori_loop(  # row by row: never materialises (w - mean)^2
      0, x.w.shape[0], lambda i, acc: acc + weight[i] * jnp.square(x.w[i] - mean),
      jnp.zeros_like(mean))
  sigma = jnp.sqrt(squares / jnp.maximum(count - ddof, 1.0))
  eps = _CV_EPS * x.scale
  return (count > ddof) & (sigma > cv_threshold * (jnp.abs(mean) + eps))


def micro_classes(x: _Scaled, num_mic: int) -> chex.Array:
  """`(M, n)` MIC category of every entry: equal-width bins (Eq. 8-9).

  int8 (int32 if `num_mic > 127`): the smallest type keeps the one-hot passes
  of `category_agreement` and `_cluster_vote` cheap.
  """
  width = (x.hi - x.lo) / num_mic
  spread = width > 0
  raw = jnp.floor((x.w - x.lo) / jnp.where(spread, width, 1.0))
  dtype = jnp.int8 if num_mic <= 127 else jnp.int32
  return jnp.where(spread, jnp.clip(raw, 0, num_mic - 1), 0).astype(dtype)


def category_agreement(categories: chex.Array, high: chex.Array,
                       num_mic: int) -> chex.Array:
  """int32 `(M, M)` number of high positions where bins agree (Eq. 10 times `|H|`).

  Exact integer counts, so that the clustering decides its ties and `q* >= p*`
  exactly, not by rounding of `k / |H|`.
  """
  total = jnp.zeros((categories.shape[0],) * 2, jnp.int32)
  for v in range(num_mic):
    e = ((categories == v) & high).astype(jnp.int8)
    total = total + _count_dot(e, e, b_axis=1)
  return total


def _ratio_greater(a: chex.Array, b: chex.Array, c: chex.Array,
                   d: chex.Array) -> chex.Array:
  """`a / b > c / d` exactly for int32 `a, c >= -1` and `1 <= b, d <= M`.

  Quotients and remainders: `r_a d` and `r_c b` stay below `M^2 < 2^31`.
  """
  qa, ra = jax.lax.div(a, b), jax.lax.rem(a, b)    # truncating: -1 -> (0, -1)
  qc, rc = jax.lax.div(c, d), jax.lax.rem(c, d)
  return (qa > qc) | ((qa == qc) & (ra * d > rc * b))


class _Clustering(NamedTuple):
  """State of the greedy MAC clustering.

  `sums[g]` is the sum of cluster g's members' agreement-count rows, updated as
  clients join, so each step's average linkage `sums[g, c] / sizes[g]` costs
  `(num_mac, M)`, not a `(num_mac, M) x (M, M)` product. All int32: linkages
  are compared as exact ratios of integers.
  """
  member: chex.Array   # (M,): cluster of each client, -1 if free
  count: chex.Array    # (): clusters opened
  sums: chex.Array     # (num_mac, M)
  sizes: chex.Array    # (num_mac,)


def _best_cluster(sums: chex.Array, sizes: chex.Array, exists: chex.Array
                  ) -> tuple[chex.Array, chex.Array, chex.Array]:
  """Per column of `sums (num_mac, ...)`, the existing cluster of highest average
  linkage `sums[g] / sizes[g]` (first on ties), compared exactly.

  Every pair of clusters at once: g wins a column if it beats each earlier
  cluster strictly and no later one beats it. Returns its index, sum and
  size; a column with no cluster gets sum -1.
  """
  lead = (-1,) + (1,) * (sums.ndim - 1)
  s = jnp.where(exists.reshape(lead), sums, -1)
  n = jnp.broadcast_to(jnp.maximum(sizes, 1).reshape(lead), s.shape)
  greater = _ratio_greater(s[:, None], n[:, None], s[None, :], n[None, :])
  order = jnp.arange(sums.shape[0])
  earlier = (order[None, :] < order[:, None]).reshape((sums.shape[0],) * 2 + lead[1:])
  beats = jnp.where(earlier, greater, ~jnp.swapaxes(greater, 0, 1))
  wins = jnp.all(beats | jnp.eye(sums.shape[0], dtype=bool).reshape(earlier.shape),
                 axis=1)
  g = jnp.argmax(wins, axis=0)
  pick = lambda x: jnp.take_along_axis(x, g[None], axis=0)[0]
  return g.astype(jnp.int32), pick(s), pick(n)


def _best_free_pair(upper: chex.Array, free: chex.Array
                    ) -> tuple[chex.Array, chex.Array, chex.Array]:
  """Count, row and column of the first best pair `a < b` of free clients.

  `upper` holds the agreement counts above the diagonal and -1 elsewhere. A
  reduction along rows, then one row: the first maximum in row-major order
  without a variadic argmax over the `(M, M)` matrix.
  """
  row_best = jnp.max(jnp.where(free[None, :], upper, -1), axis=1)
  row_best = jnp.where(free, row_best, -1)
  a = jnp.argmax(row_best)
  b = jnp.argmax(jnp.where(free, upper[a], -1))
  return row_best[a], a, b


def _clustering_step(state: _Clustering, similarity: chex.Array, upper: chex.Array,
                     mask: chex.Array, num_mac: int) -> _Clustering:
  """One greedy MAC step: join the best cluster or open one from the best pair.

  The best join is the first maximum in (cluster, client) order: per cluster
  the first best free client (one denominator), then the clusters in order.
  """
  free = mask & (state.member < 0)
  num_free = jnp.sum(free)
  pair_count, a, b = _best_free_pair(upper, free)
  exists = jnp.arange(num_mac) < state.count
  row = jnp.where(free[None, :], state.sums, -1)
  cols = jnp.argmax(row, axis=1)
  firsts = jnp.take_along_axis(row, cols[:, None], axis=1)[:, 0]
  g, join_sum, join_size = _best_cluster(firsts, state.sizes, exists)
  c = cols[g]
  has_pair, has_join = num_free >= 2, (state.count > 0) & (num_free >= 1)
  active = (state.count < num_mac) & (has_pair | has_join)
  # q* >= p* with p* an integer count: floor(sum / size) >= p*.
  join = has_join & (~has_pair | (jax.lax.div(join_sum, join_size) >= pair_count))
  joined = _Clustering(state.member.at[c].set(g), state.count,
                       state.sums.at[g].add(similarity[c]),
                       state.sizes.at[g].add(1))
  opened = _Clustering(state.member.at[a].set(state.count).at[b].set(state.count),
                       state.count + 1,
                       state.sums.at[state.count].set(similarity[a] + similarity[b]),
                       state.sizes.at[state.count].set(2))
  new = jax.tree.map(lambda x, y: jnp.where(join, x, y), joined, opened)
  return jax.tree.map(lambda x, y: jnp.where(active, x, y), new, state)


def macro_classes(similarity: chex.Array, mask: chex.Array, num_mac: int,
                  sim_threshold: chex.Numeric, num_high: chex.Array) -> chex.Array:
  """int32 `(M,)` MAC cluster of each client, -1 for unclustered (Sec. 3, MAC).

  Greedy average-linkage clustering: while fewer than `num_mac` clusters exist
  and clients are left, the best unassigned client joins its best cluster if
  that beats the best unassigned pair (`q* >= p*`), else the best pair opens a
  new cluster (ties: lowest indices). Then each remaining client joins its most
  similar (frozen) cluster (ties: lowest index) if the similarity exceeds
  `sim_threshold`. `similarity` holds int32 agreement counts (`M <= 46340`,
  sums below `2^31`); `num_high` (`|H|`) turns them into fractions for the
  threshold test.

  Every linkage comparison is exact: linkages are ratios of integers. The
  threshold test reads a linkage within a relative `2^-20` of `sim_threshold`
  as equal to it (not above): a linkage of exactly 1/5 never exceeds
  `sim_threshold=0.2`, whichever way 0.2 rounds in float32.

  At most `M - 1` steps of `O(M^2)` (the best free pair) in a `lax.fori_loop`;
  once no step can change the clustering, the remaining ones are no-ops.
  """
  m = similarity.shape[0]
  upper = jnp.where(jnp.triu(jnp.ones((m, m), bool), k=1), similarity, -1)
  start = _Clustering(jnp.full((m,), -1, jnp.int32), jnp.zeros((), jnp.int32),
                      jnp.zeros((num_mac, m), jnp.int32),
                      jnp.zeros((num_mac,), jnp.int32))
  state = jax.lax.fori_loop(
      0, max(m - 1, 0),
      lambda _, s: _clustering_step(s, similarity, upper, mask, num_mac), start)
  exists = jnp.arange(num_mac) < state.count
  best, total, size = _best_cluster(state.sums, state.sizes, exists)
  linkage = total / (size * jnp.maximum(num_high, 1)).astype(jnp.float32)
  above = linkage > sim_threshold + _THRESHOLD_TIE * jnp.abs(sim_threshold)
  late = mask & (state.member < 0) & (total >= 0) & above
  return jnp.where(late, best, state.member)


def _cluster_vote(w: chex.Array, categories: chex.Array, member: chex.Array,
                  num_mic: int, num_mac: int) -> chex.Array:
  """`theta_j = sum_g alpha_gj P_gj` over clusters (Eq. 11-15)."""
  onehot = (member[None, :] == jnp.arange(num_mac)[:, None]).astype(w.dtype)
  sizes = jnp.sum(onehot, axis=1)
  exists = sizes > 0
  means = jnp.matmul(onehot, w, precision=_HIGHEST) / jnp.maximum(sizes, 1.0)[:, None]
  # Mode E_gj (first maximum on ties), support v_gj and theta_j as elementwise
  # loops over the few categories and clusters: on XLA-CPU reductions over
  # leading axes are much slower than the `(num_mac, n)` elementwise passes.
  members = onehot.astype(jnp.int8)
  mode = jnp.zeros(means.shape, jnp.int32)
  best = _count_dot(members, (categories == 0).astype(jnp.int8))
  for v in range(1, num_mic):
    votes = _count_dot(members, (categories == v).astype(jnp.int8))
    mode, best = jnp.where(votes > best, v, mode), jnp.maximum(votes, best)
  support = sum((mode == mode[h]) & exists[h] for h in range(num_mac)) * exists[:, None]
  alpha = support / jnp.maximum(sum(support[g] for g in range(num_mac)), 1)
  return sum(alpha[g] * means[g] for g in range(num_mac))


class _LeafStatistics(NamedTuple):
  """Steps 1-4 of FedSA on one flattened leaf `w (M, n)`."""
  w: chex.Array
  scaled: _Scaled
  high: chex.Array
  categories: chex.Array
  similarity: chex.Array


def _leaf_statistics(leaf: chex.Array, mask: chex.Array, cv_threshold: chex.Numeric,
                     num_mic: int, ddof: int) -> _LeafStatistics:
  """Dispersion, MIC categories and agreement counts of one stacked leaf."""
  w = leaf.reshape(leaf.shape[0], -1).astype(numerics.accumulation_dtype(leaf.dtype))
  scaled = _scaled(w, mask)
  high = high_dispersion(scaled, mask, cv_threshold, ddof)
  categories = micro_classes(scaled, num_mic)
  return _LeafStatistics(w, scaled, high, categories,
                         category_agreement(categories, high, num_mic))


def _leaf_result(leaf: chex.Array, stats: _LeafStatistics, member: chex.Array,
                 average: chex.Array, num_mic: int, num_mac: int) -> chex.Array:
  """Steps 6-7 given the leaf's clusters and its FedAvg `average` (step 2);
  returns the leaf without client axis.

  The cluster means are taken on the leaf scaled per position (no overflow of
  their sums), then scaled back exactly.
  """
  average = average.reshape(-1).astype(stats.w.dtype)
  clustered = jnp.any(member >= 0)
  theta = _cluster_vote(stats.scaled.w, stats.categories, member, num_mic, num_mac)
  theta = theta * stats.scaled.unscale
  out = jnp.where(stats.high & clustered, theta, average)
  return out.reshape(leaf.shape[1:]).astype(leaf.dtype)


@functools.partial(jax.jit, static_argnames=("num_mic", "num_mac", "ddof"))
def _fedsa(params: types.Stacked, num_samples: chex.Array | None,
           mask: chex.Array | None, cv_threshold: chex.Numeric,
           sim_threshold: chex.Numeric, *, num_mic: int, num_mac: int,
           ddof: int) -> types.Tree:
  """`fedsa` after its boundary checks, compiled once per structure."""
  safe = weights_lib.zero_masked(params, mask)
  leaves, treedef = jax.tree.flatten(safe)
  m = leaves[0].shape[0]
  mask = jnp.ones((m,), bool) if mask is None else mask
  client = weights_lib.client_weights(num_samples, m, mask,
                                      numerics.weight_dtype(params))
  stats = [_leaf_statistics(x, mask, cv_threshold, num_mic, ddof) for x in leaves]
  # Step 5 for all leaves at once: one batched loop compiles and runs faster
  # than a loop per leaf.
  members = jax.vmap(macro_classes, in_axes=(0, None, None, None, 0))(
      jnp.stack([s.similarity for s in stats]), mask, num_mac, sim_threshold,
      jnp.stack([jnp.sum(s.high, dtype=jnp.int32) for s in stats]))
  averages = jax.tree.leaves(fedavg_lib.average(safe, client))   # step 2 (Eq. 7)
  weighted = jnp.sum(client) > 0         # traced zero total weight: zeros
  return jax.tree.unflatten(treedef, [
      jnp.where(weighted, _leaf_result(x, s, members[i], a, num_mic, num_mac),
                jnp.zeros((), x.dtype))
      for i, (x, s, a) in enumerate(zip(leaves, stats, averages))])


def _check_count_range(params: types.Stacked, m: int) -> None:
  """Raises unless every leaf's agreement sums fit int32 (`M max(M, n) < 2^31`)."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    n = int(np.prod(np.shape(leaf)[1:], dtype=np.int64))
    if m * max(m, n) >= _INT32_LIMIT:
      raise ValueError(
          f"params: fedsa counts bin agreements exactly in int32 and needs "
          f"M * max(M, n) < 2**31 per leaf; leaf '{jax.tree_util.keystr(path)}' has "
          f"M = {m} clients and n = {n} entries per client.")


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
    params: stacked client parameters (float16, bfloat16, float32, or float64
      under x64; statistics in float32 or the wider input dtype).
    num_samples: optional `(M,)` sample counts for the low-dispersion average.
    cv_threshold: `tau`, threshold on the coefficient of variation (paper: 0.2).
    num_mic: number of MIC bins (>= 2; paper: 4, 5 for 100 classes, 8 for 200).
    num_mac: maximum number of MAC clusters (>= 1; paper: as `num_mic`).
    sim_threshold: similarity above which a late client joins a cluster (0.2).
    ddof: delta degrees of freedom of the standard deviation.
    mask: optional bool `(M,)`; False clients are excluded from every step.

  Returns:
    The global model: a tree without the client axis.

  Raises:
    ValueError: if no unmasked client has a positive weight (concrete inputs;
      traced ones give zeros), or a leaf has `M max(M, n) >= 2^31` (the exact
      int32 agreement counts would overflow). TypeError for non-floating or
      complex leaves.

  Notes:
    The paper's equations were lost in its text; this follows the
    reconstruction in docs/methods.md#fedsa and reproduces its worked examples.
    Clustering is at most `M - 1` greedy steps of `O(M^2)` in a
    `lax.fori_loop`, so it jits with static M. Ties are decided exactly: agreement
    counts are int32 and average linkages are compared as ratios of integers (so
    5/25 equals 4/20); a linkage within a relative 2^-20 of `sim_threshold` counts
    as equal to it. Steps 1-3 and the cluster means run on the leaf scaled per
    position by a power of two (exact; CV and bins are scale invariant), so
    magnitudes up to the dtype's maximum neither overflow nor fall back to FedAvg.
    The CV test is strict: `cv_j == tau` is low dispersion. Validation runs on the
    host, then one jitted implementation per structure and static arguments, so
    eager calls after the first cost as much as jitted ones.

  References:
    "FedSA: the Key of Parameter Skew in Federated Learning", Sec. 3,
    Eq. (2)-(15) and Algorithm 1.
  """
  m, mask = checks.client_params(params, mask)
  weights_lib.check_client_vector(num_samples, m, "num_samples")
  checks.some_weight(num_samples, mask)
  checks.check_range("cv_threshold", cv_threshold, 0.0, None)
  checks.check_range("sim_threshold", sim_threshold, None, None)
  checks.integer_at_least(num_mic, "num_mic", 2)
  checks.integer_at_least(num_mac, "num_mac", 1)
  checks.integer_at_least(ddof, "ddof", 0)
  _check_count_range(params, m)
  return _fedsa(params, num_samples, mask, cv_threshold, sim_threshold,
                num_mic=num_mic, num_mac=num_mac, ddof=ddof)
