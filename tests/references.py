"""Plain NumPy references for pflax.aggregate, written from the papers' equations.

Everything here loops over clients and classes in float64 and never calls pflax,
so a test comparing pflax to these functions can fail independently of pflax's
own choices. Settled points follow docs/methods.md (cited per function).
"""

from fractions import Fraction

import jax
import numpy as np
import pytest


# --------------------------------------------------------------------------- data


def random_params(rng: np.random.Generator, m: int, k: int = 5,
                  dtype=np.float32) -> dict:
  """A stacked model with odd leaf shapes: features and a `classifier/output` head."""
  def leaf(*shape):
    return rng.normal(size=(m,) + shape).astype(dtype)

  return {
      "features": {"conv": leaf(2, 3, 4), "dense": leaf(7)},
      "classifier": {"output": {"kernel": leaf(3, k), "bias": leaf(k)}},
  }


def leaves(tree) -> list[np.ndarray]:
  return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]


def unflatten_like(tree, new_leaves):
  return jax.tree.unflatten(jax.tree.structure(tree), list(new_leaves))


def map_leaves(fn, tree):
  """Applies `fn` to every leaf as a float64 NumPy array."""
  return unflatten_like(tree, [fn(x) for x in leaves(tree)])


def flat_clients(tree) -> np.ndarray:
  """`(M, D)`: each client's leaves flattened and concatenated (float64)."""
  return np.concatenate([x.reshape(x.shape[0], -1) for x in leaves(tree)], axis=1)


def is_classifier(path) -> bool:
  return any(getattr(p, "key", None) == "classifier" for p in path)


def classifier_flags(tree) -> list[bool]:
  return [is_classifier(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


# ---------------------------------------------------------------------- FedAvg


def fedavg_weights(num_samples, m: int) -> np.ndarray:
  n = np.ones(m) if num_samples is None else np.asarray(num_samples, np.float64)
  return np.array([n[i] / sum(n) for i in range(m)])


def weighted_sum(weights, x: np.ndarray) -> np.ndarray:
  """`sum_i weights[i] x[i]` by an explicit loop."""
  out = np.zeros(x.shape[1:])
  for i in range(x.shape[0]):
    out = out + weights[i] * x[i]
  return out


def fedavg_ref(params, num_samples=None):
  """McMahan et al. / cwFedAvg Eq. (1): `w = sum_i n_i w_i / sum_l n_l`."""
  def one(x):
    return weighted_sum(fedavg_weights(num_samples, x.shape[0]), x)
  return map_leaves(one, params)


def fedclassavg_ref(params, num_samples=None):
  """FedClassAvg Eq. (3): classifier leaves -> FedAvg mean in every client."""
  out = []
  for flag, x in zip(classifier_flags(params), leaves(params)):
    if flag:
      mean = weighted_sum(fedavg_weights(num_samples, x.shape[0]), x)
      x = np.stack([mean] * x.shape[0])
    out.append(x)
  return unflatten_like(params, out)


# -------------------------------------------------------------------- cwFedAvg


def cw_statistics(class_dist, num_samples=None):
  """`(p_i, p_ij, q_ij)` of cwFedAvg Eq. (5)-(6) with the settled cases of docs/methods.md#cwfedavg."""
  c = np.asarray(class_dist, np.float64)
  m, k = c.shape
  if num_samples is None:
    n = [sum(c[i]) for i in range(m)]
  else:
    n = list(np.asarray(num_samples, np.float64))
  p = [n[i] / sum(n) for i in range(m)]
  dist = np.zeros((m, k))
  for i in range(m):
    row = sum(c[i])
    for j in range(k):
      dist[i, j] = c[i, j] / row if row > 0 else 1.0 / k
  q = np.zeros((m, k))
  for j in range(k):
    total = sum(p[l] * dist[l, j] for l in range(m))
    for i in range(m):
      q[i, j] = p[i] * dist[i, j] / total if total > 0 else p[i]
  return np.array(p), dist, q


def class_models_ref(params, class_dist, num_samples=None):
  """Eq. (5)-(6): `G_j = sum_i q_ij w_i`, stacked over classes."""
  _, _, q = cw_statistics(class_dist, num_samples)
  k = q.shape[1]
  return map_leaves(
      lambda x: np.stack([weighted_sum(q[:, j], x) for j in range(k)]), params)


def personalize_ref(class_models, class_dist):
  """Eq. (7): `w_i = sum_j p_ij G_j`, rows of class_dist normalised (0 -> 1/K)."""
  c = np.asarray(class_dist, np.float64)
  m, k = c.shape
  dist = np.array([[c[i, j] / c[i].sum() if c[i].sum() > 0 else 1.0 / k
                    for j in range(k)] for i in range(m)])
  return map_leaves(
      lambda g: np.stack([weighted_sum(dist[i], g) for i in range(m)]), class_models)


def cw_fedavg_ref(params, class_dist, num_samples=None, selected=None):
  """Eq. (5)-(7) on selected leaves, FedAvg with `p_i` on the others."""
  p, dist, q = cw_statistics(class_dist, num_samples)
  m, k = dist.shape
  selected = selected or [True] * len(jax.tree.leaves(params))
  out = []
  for flag, x in zip(selected, leaves(params)):
    if flag:
      g = [weighted_sum(q[:, j], x) for j in range(k)]
      out.append(np.stack([weighted_sum(dist[i], np.stack(g)) for i in range(m)]))
    else:
      out.append(np.stack([weighted_sum(p, x)] * m))
  return unflatten_like(params, out)


def estimate_class_dist_ref(kernel):
  """Eq. (4): `p~_j = ||w_j|| / sum_k ||w_k||` over the input axis (-2)."""
  kernel = np.asarray(kernel, np.float64)
  lead, (f, k) = kernel.shape[:-2], kernel.shape[-2:]
  out = np.zeros(lead + (k,))
  for idx in np.ndindex(*lead):
    norms = [np.sqrt(sum(kernel[idx + (a, j)] ** 2 for a in range(f))) for j in range(k)]
    total = sum(norms)
    out[idx] = [nj / total if total > 0 else 1.0 / k for nj in norms]
  return out


# ---------------------------------------------------------------------- FedDWA


def cosine_matrix(vectors: np.ndarray) -> np.ndarray:
  """Cosines between rows; any pair involving a zero vector has cosine 0."""
  m = vectors.shape[0]
  out = np.zeros((m, m))
  for a in range(m):
    for b in range(m):
      na, nb = np.linalg.norm(vectors[a]), np.linalg.norm(vectors[b])
      if na > 0 and nb > 0:
        out[a, b] = vectors[a] @ vectors[b] / (na * nb)
  return out


def feddwa_weights_ref(params, received, alpha=0.2, temperature=1.0):
  """FedDWA Eq. (3)-(6) as settled in docs/methods.md#feddwa (softmax over k != i, self alpha).

  Each peer softmax is shifted by its largest `s_ik / T` (k != i) before `exp`,
  which leaves it unchanged mathematically and keeps T -> 0 finite in float64.
  """
  s = cosine_matrix(flat_clients(params) - flat_clients(received))
  m = s.shape[0]
  if m == 1:
    return np.ones((1, 1))
  beta = np.zeros((m, m))
  for i in range(m):
    top = max(s[i, k] / temperature for k in range(m) if k != i)
    denom = sum(np.exp(s[i, k] / temperature - top) for k in range(m) if k != i)
    for j in range(m):
      beta[i, j] = alpha if j == i else (
          (1 - alpha) * np.exp(s[i, j] / temperature - top) / denom)
  return beta


def feddwa_ref(params, received, alpha=0.2, temperature=1.0):
  """`w_{g,i}^{t+1} = alpha w_i + sum_{j != i} beta_ij w_j` (mixes trained models)."""
  beta = feddwa_weights_ref(params, received, alpha, temperature)
  m = beta.shape[0]
  return map_leaves(lambda x: np.stack([weighted_sum(beta[i], x) for i in range(m)]),
                    params)


# --------------------------------------------------------------------- FedReMa


def soft_logits_ref(logits, temperature=0.5):
  z = np.asarray(logits, np.float64) / temperature
  out = np.zeros_like(z)
  for k in range(z.shape[0]):
    e = np.exp(z[k] - z[k].max())
    out[k] = e / e.sum()
  return out


def relevance_ref(soft):
  """FedReMa Eq. (5): cosine similarity of soft logits in [0, 1], diagonal 1."""
  s = np.clip(cosine_matrix(np.asarray(soft, np.float64)), 0.0, 1.0)
  np.fill_diagonal(s, 1.0)
  return s


MDS_TIE = 2.0 ** -17   # pflax.fedrema: similarities this close count as equal


def mds_ref(s_row):
  """The settled MDS of docs/methods.md#fedrema: ascending sort, drop the top gap, cut at the first
  largest remaining gap, select every client above the cut.

  With `fedrema.mds`'s documented rule against rounding: gaps up to `MDS_TIE`
  are 0, a gap within `MDS_TIE` of the largest ties with it, and every client
  within `MDS_TIE` of the lowest selected one is selected (ties by value).
  """
  s = np.asarray(s_row, np.float64)
  m = len(s)
  if m <= 2:
    return np.ones(m, bool), 0.0
  ascending = sorted(s)
  gaps = [ascending[t + 1] - ascending[t] for t in range(m - 2)]  # top gap excluded
  gaps = [g if g > MDS_TIE else 0.0 for g in gaps]
  cut = min(t for t in range(len(gaps)) if gaps[t] >= max(gaps) - MDS_TIE)
  selected = np.array([s[i] >= ascending[cut + 1] - MDS_TIE for i in range(m)])
  return selected, gaps[cut]


def fedrema_ref(params, num_samples, soft, dependency, max_gap, in_ccp, delta=0.5):
  """One FedReMa server round (Eq. 6-10, Algorithms 1-2), docs/methods.md#fedrema.

  Returns `(params, dependency, max_gap, in_ccp)`.
  """
  flags = classifier_flags(params)
  m = leaves(params)[0].shape[0]
  n = np.ones(m) if num_samples is None else np.asarray(num_samples, np.float64)
  dependency = np.array(dependency, np.int64)
  mixing = np.zeros((m, m))
  if in_ccp:
    s = relevance_ref(soft)
    gaps = []
    for k in range(m):
      chosen, gap = mds_ref(s[k])
      gaps.append(gap)
      total = sum(n[i] for i in range(m) if chosen[i])
      for i in range(m):
        if chosen[i]:
          mixing[k, i] = n[i] / total
          dependency[k, i] += 1
    gap_bar = sum(gaps) / m
    max_gap = max(float(max_gap), gap_bar)
    in_ccp = bool(max_gap > 0 and gap_bar / max_gap >= delta)
  else:
    for k in range(m):
      total = sum(dependency[k])
      for i in range(m):
        mixing[k, i] = dependency[k, i] / total
  out = []
  for flag, x in zip(flags, leaves(params)):
    if flag:
      out.append(np.stack([weighted_sum(mixing[k], x) for k in range(m)]))
    else:
      out.append(np.stack([weighted_sum(fedavg_weights(n, m), x)] * m))
  return unflatten_like(params, out), dependency, max_gap, in_ccp


# ------------------------------------------------------------------------ FedSA


def _mean(values) -> Fraction:
  values = list(values)
  return sum(values, Fraction(0)) / len(values)


def fedsa_clusters(sim, num_mac: int, sim_threshold: float) -> list[list[int]]:
  """FedSA step 5 (docs/methods.md#fedsa) with exact rational similarities.

  Pairs are ranked by similarity, then lowest `(a, b)`; joins by similarity, then
  lowest `(cluster, client)`. `sim_threshold` is read as the decimal it prints as
  (`Fraction(str(t))`), so a linkage equal to it is never above it, whichever
  way the float rounds.
  """
  threshold = Fraction(str(sim_threshold))
  m = len(sim)
  free = list(range(m))
  clusters: list[list[int]] = []
  while len(clusters) < num_mac and free:
    pairs = [(sim[a][b], -a, -b) for a in free for b in free if a < b]
    joins = [(_mean(sim[i][c] for i in g), -gi, -c)
             for gi, g in enumerate(clusters) for c in free]
    best_pair, best_join = max(pairs, default=None), max(joins, default=None)
    if best_join is not None and (best_pair is None or best_join[0] >= best_pair[0]):
      _, g, c = best_join
      clusters[-g].append(-c)
      free.remove(-c)
    elif best_pair is not None:
      _, a, b = best_pair
      clusters.append([-a, -b])
      free.remove(-a)
      free.remove(-b)
    else:
      break
  frozen = [list(g) for g in clusters]
  for c in free:
    if not frozen:
      break
    links = [_mean(sim[i][c] for i in g) for g in frozen]
    best = max(range(len(links)), key=lambda g: (links[g], -g))
    if links[best] > threshold:
      clusters[best].append(c)
  return clusters


def fedsa_leaf_ref(w, num_samples=None, cv_threshold=0.2, num_mic=4, num_mac=4,
                   sim_threshold=0.2, ddof=1):
  """FedSA steps 1-7 (docs/methods.md#fedsa) on one leaf, `w` of shape `(M, ...)`."""
  shape = np.shape(w)[1:]
  w = np.asarray(w, np.float64).reshape(np.shape(w)[0], -1)
  m, size = w.shape
  p = fedavg_weights(num_samples, m)
  out = np.array([sum(p[k] * w[k, j] for k in range(m)) for j in range(size)])
  high = []
  for j in range(size):
    col = w[:, j]
    mu = sum(col) / m
    if m - ddof <= 0:
      continue
    sigma = np.sqrt(sum((x - mu) ** 2 for x in col) / (m - ddof))
    if sigma / (abs(mu) + 1e-12) > cv_threshold:
      high.append(j)
  if not high:
    return out.reshape(shape)
  cat = {}
  for j in high:
    lo, hi = min(w[:, j]), max(w[:, j])
    width = (hi - lo) / num_mic
    for k in range(m):
      cat[k, j] = min(num_mic - 1, int(np.floor((w[k, j] - lo) / width)))
  sim = [[Fraction(sum(cat[a, j] == cat[b, j] for j in high), len(high))
          for b in range(m)] for a in range(m)]
  clusters = fedsa_clusters(sim, num_mac, sim_threshold)
  if not clusters:
    return out.reshape(shape)
  for j in high:
    modes, means = [], []
    for g in clusters:
      votes = [sum(cat[k, j] == v for k in g) for v in range(num_mic)]
      modes.append(max(range(num_mic), key=lambda v: (votes[v], -v)))
      means.append(sum(w[k, j] for k in g) / len(g))
    support = [sum(modes[h] == modes[g] for h in range(len(clusters)))
               for g in range(len(clusters))]
    out[j] = sum(support[g] / sum(support) * means[g] for g in range(len(clusters)))
  return out.reshape(shape)


def fedsa_ref(params, num_samples=None, **kwargs):
  return map_leaves(lambda x: fedsa_leaf_ref(x, num_samples, **kwargs), params)


# ------------------------------------------------------------ test utilities


def no_jit(f):
  return f


def sweep(jit_cases, no_jit_cases):
  """pytest params `(transform, *case)`: every case under `jax.jit`, a few without.

  Without jit each new shape compiles every primitive separately, so the no-jit
  cases are kept few and share shapes across tests.
  """
  params = []
  for transform, name, cases in ((jax.jit, "jit", jit_cases),
                                 (no_jit, "nojit", no_jit_cases)):
    for case in cases:
      case = case if isinstance(case, tuple) else (case,)
      ident = "-".join(map(str, (name,) + case))
      params.append(pytest.param(transform, *case, id=ident))
  return params


def assert_tree_close(actual, expected, rtol=2e-5, atol=2e-5):
  """Same structure, same shapes, values close (compared in float64)."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    assert np.shape(a) == np.shape(e), (np.shape(a), np.shape(e))
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(e, np.float64),
                               rtol=rtol, atol=atol)


# ------------------------------------------------------------- client losses


def cross_entropy_ref(logits, labels, mask=None):
  """Softmax cross-entropy `-log softmax(z)_y`, averaged over the valid examples."""
  logits = np.asarray(logits, np.float64)
  mask = np.ones(len(labels), bool) if mask is None else np.asarray(mask, bool)
  terms = []
  for row, label, valid in zip(logits, labels, mask):
    if valid:
      top = row.max()
      terms.append(-(row[label] - top - np.log(np.exp(row - top).sum())))
  return sum(terms) / max(len(terms), 1)


def supcon_ref(features, labels, temperature, base_temperature, mask=None):
  """Khosla et al. (2020) Eq. 2 (L_out), one anchor at a time; anchors without a
  positive are skipped, padded examples are neither anchors nor contrasted."""
  z = np.asarray(features, np.float64)
  n = len(labels)
  mask = np.ones(n, bool) if mask is None else np.asarray(mask, bool)
  per_anchor = []
  for i in range(n):
    others = [a for a in range(n) if a != i and mask[a]]
    positives = [p for p in others if labels[p] == labels[i]]
    if not mask[i] or not positives:
      continue
    log_den = np.log(sum(np.exp(z[i] @ z[a] / temperature) for a in others))
    mean_log_prob = sum(z[i] @ z[p] / temperature - log_den
                        for p in positives) / len(positives)
    per_anchor.append(-(temperature / base_temperature) * mean_log_prob)
  return sum(per_anchor) / len(per_anchor) if per_anchor else 0.0


def proximal_ref(params, anchor, reduce="sum"):
  """`0.5 * sum_leaves sum((p - a)^2)`, or with "mean" each leaf's mean instead."""
  total = 0.0
  for p, a in zip(leaves(params), leaves(anchor)):
    sq = (p - a) ** 2
    total += sq.sum() if reduce == "sum" else sq.sum() / sq.size
  return 0.5 * total


# ------------------------------------------- property tests (test_properties.py)


def mix_ref(weights, stacked):
  """`out[o] = sum_m weights[o, m] stacked[m]` by an explicit loop (docs/methods.md, common rules)."""
  w = np.asarray(weights, np.float64)
  return map_leaves(lambda x: np.stack([weighted_sum(w[o], x) for o in range(len(w))]),
                    stacked)


def finite_clients_ref(stacked) -> np.ndarray:
  """True for clients whose every leaf entry is finite."""
  flat = [np.asarray(x, np.float64).reshape(np.shape(x)[0], -1)
          for x in jax.tree.leaves(stacked)]
  return np.array([all(np.all(np.isfinite(x[i])) for x in flat)
                   for i in range(flat[0].shape[0])])


def _dot(a, b) -> float:
  """Loop dot product: the same operations for equal rows, so `<a,a> == <a,b>`."""
  out = 0.0
  for x, y in zip(a, b):
    out += float(x) * float(y)
  return out


def relevance_exact_ref(soft):
  """FedReMa Eq. (5) with identical rows at exactly 1.

  `cos = <a,b> / sqrt(<a,a> <b,b>)`: for equal rows `<a,b> = <a,a>` and the
  correctly rounded `sqrt(x * x)` is `x`, so the cosine is exactly 1 (a tie,
  not a rounding gap); values are clipped to 1 and the diagonal is 1. Rows of
  zeros have cosine 0 with everything.
  """
  s = np.asarray(soft, np.float64)
  m = s.shape[0]
  out = np.eye(m)
  for a in range(m):
    for b in range(m):
      na, nb = _dot(s[a], s[a]), _dot(s[b], s[b])
      if a != b and na > 0 and nb > 0:
        out[a, b] = min(1.0, _dot(s[a], s[b]) / np.sqrt(na * nb))
  return out


def _mds_sorted(values):
  """Sorted values, gaps without the top one, and the first largest gap's index."""
  values = sorted(values)
  gaps = [values[t + 1] - values[t] for t in range(len(values) - 2)]
  cut = max(range(len(gaps)), key=lambda t: (gaps[t], -t))
  return values, gaps, cut


def mds_value_ref(s_row, valid=None):
  """The MDS of docs/methods.md#fedrema among `valid` clients, ties resolved by value (`mds` Notes).

  Sort ascending, drop the top gap, cut at the first largest remaining gap and
  select every valid client whose similarity is at least the value just above
  the cut, so equal similarities are selected together. With at most two
  valid clients, all valid ones are selected with gap 0.
  """
  s = np.asarray(s_row, np.float64)
  valid = np.ones(len(s), bool) if valid is None else np.asarray(valid, bool)
  if valid.sum() <= 2:
    return valid.copy(), 0.0
  values, gaps, cut = _mds_sorted(s[valid])
  return valid & (s >= values[cut + 1]), gaps[cut]


def fedrema_masked_ref(params, num_samples, soft, dependency, max_gap, in_ccp,
                       delta=0.5, mask=None, selected=None):
  """One FedReMa server round with a client mask (docs/methods.md#fedrema, issue 11 item 9).

  Leaves not `selected` (the feature extractor): FedAvg with `n_i` over the
  valid clients, given to every client, masked ones included. Classifier
  leaves: in the CCP each valid client k mixes its MDS peers (`mds_value_ref`
  on `relevance_exact_ref`, Eq. 7) and `dependency[k, A_k] += 1`; after it,
  `g_ki / sum_i g_ki` over valid peers (Eq. 10; a zero row keeps its own).
  Masked clients keep their classifier and their history. Returns
  `(params, dependency, max_gap, in_ccp)`.
  """
  m = leaves(params)[0].shape[0]
  valid = np.ones(m, bool) if mask is None else np.asarray(mask, bool)
  selected = selected or classifier_flags(params)
  n = np.ones(m) if num_samples is None else np.asarray(num_samples, np.float64)
  n = np.where(valid, n, 0.0)
  dependency = np.array(dependency, np.int64)
  mixing = np.eye(m)
  if in_ccp:
    keep = np.flatnonzero(valid)
    s = np.zeros((m, m))
    s[np.ix_(keep, keep)] = relevance_exact_ref(np.asarray(soft, np.float64)[keep])
    gaps = []
    for k in keep:
      chosen, gap = mds_value_ref(s[k], valid)
      gaps.append(gap)
      mixing[k] = np.where(chosen, n, 0.0) / sum(n[i] for i in range(m) if chosen[i])
      dependency[k] += chosen
    gap_bar = sum(gaps) / len(gaps)
    max_gap = max(float(max_gap), gap_bar)
    in_ccp = bool(max_gap > 0 and gap_bar / max_gap >= delta)
  else:
    for k in np.flatnonzero(valid):
      row = np.where(valid, dependency[k], 0).astype(np.float64)
      if row.sum() > 0:
        mixing[k] = row / row.sum()
  p = n / n.sum()
  out = []
  for flag, x in zip(selected, leaves(params)):
    if flag:
      mixed = [weighted_sum(mixing[k], np.where(
          valid.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0.0)) for k in range(m)]
      out.append(np.stack([mixed[k] if valid[k] else x[k] for k in range(m)]))
    else:
      x = np.where(valid.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0.0)
      out.append(np.stack([weighted_sum(p, x)] * m))
  return unflatten_like(params, out), dependency, max_gap, in_ccp


def fedrema_margin(soft, mask, max_gap, in_ccp, delta=0.5) -> float:
  """How far one FedReMa CCP round is from a decision that rounding could flip.

  0 when two unequal similarities of a row, two candidate gaps, or the CCP
  ratio and `delta` are closer than float32 can tell apart, or when two
  non-identical clients have exactly equal similarities; otherwise the
  smallest such distance (inf if no decision depends on a comparison).
  Identical soft rows are exact ties (`relevance_exact_ref`) and need no margin.
  """
  if not in_ccp:
    return np.inf
  soft = np.asarray(soft, np.float64)
  valid = np.asarray(mask, bool)
  keep = np.flatnonzero(valid)
  if len(keep) <= 2:
    return np.inf                            # gap 0: no comparison decides
  s = relevance_exact_ref(soft[keep])
  margin, gaps = np.inf, []
  for k in range(len(keep)):
    row = s[k]
    for a in range(len(keep)):
      for b in range(a + 1, len(keep)):
        same = np.array_equal(soft[keep[a]], soft[keep[b]])
        if row[a] == row[b] and not same:
          return 0.0
        if row[a] != row[b]:
          margin = min(margin, abs(row[a] - row[b]))
    _, row_gaps, cut = _mds_sorted(row)
    for t, g in enumerate(row_gaps):
      if t != cut and g != row_gaps[cut]:
        margin = min(margin, row_gaps[cut] - g)
      elif t != cut and g > 0:
        return 0.0                           # equal non-zero gaps: first wins
    gaps.append(row_gaps[cut])
  gap_bar = sum(gaps) / len(gaps)
  new_max = max(float(max_gap), gap_bar)
  if new_max > 0:
    margin = min(margin, new_max, abs(gap_bar - delta * new_max))
  return margin


def fedsa_cv_margin(w, cv_threshold=0.2, ddof=1) -> float:
  """Smallest relative distance of a position's coefficient of variation from
  the threshold (docs/methods.md#fedsa, step 1), computed in float64 on one leaf `(M, ...)`."""
  w = np.asarray(w, np.float64).reshape(np.shape(w)[0], -1)
  m = w.shape[0]
  if m - ddof <= 0:
    return np.inf
  mu = w.mean(axis=0)
  sigma = np.sqrt(((w - mu) ** 2).sum(axis=0) / (m - ddof))
  cv = sigma / (np.abs(mu) + 1e-12)
  return float(np.min(np.abs(cv - cv_threshold)) / max(cv_threshold, 1e-12))




# ------------------------------------ robust options (docs/methods.md#robust-options)


def update_norms_ref(params, reference) -> np.ndarray:
  """`||w_i - r||` over the whole tree, in Python floats (no overflow at 1e30)."""
  flat = [np.asarray(x, np.float64).reshape(np.shape(x)[0], -1)
          - np.asarray(r, np.float64).reshape(1, -1)
          for x, r in zip(jax.tree.leaves(params), jax.tree.leaves(reference))]
  return np.array([np.sqrt(sum(float(v) ** 2 for d in flat for v in d[i]))
                   for i in range(flat[0].shape[0])])


def median_ref(params, mask=None):
  """Coordinate-wise median of the unmasked clients (`np.median`: mean of the two
  middle values for an even count)."""
  def one(x):
    x = np.asarray(x, np.float64)
    keep = np.ones(x.shape[0], bool) if mask is None else np.asarray(mask)
    return np.median(x[keep], axis=0)
  return map_leaves(one, params)


def trimmed_mean_ref(params, trim_fraction, mask=None):
  """Per coordinate: sort the k unmasked values, drop floor(beta k) at each end,
  average the rest (a loop over coordinates)."""
  def one(x):
    x = np.asarray(x, np.float64)
    keep = np.ones(x.shape[0], bool) if mask is None else np.asarray(mask)
    rows = x[keep].reshape(int(keep.sum()), -1)
    k = rows.shape[0]
    t = int(np.floor(trim_fraction * k))
    out = [np.mean(sorted(rows[:, j])[t:k - t]) for j in range(rows.shape[1])]
    return np.array(out).reshape(x.shape[1:])
  return map_leaves(one, params)


def capped_weights_ref(num_samples, max_share, mask=None) -> np.ndarray:
  """`p_i = min(s, c n_i)` with `sum p = 1`, by bisection on c (uniform over the
  positive clients when `s < 1 / their number`)."""
  n = np.asarray(num_samples, np.float64).copy()
  if mask is not None:
    n[~np.asarray(mask)] = 0.0
  active = n > 0
  if not active.any():
    return np.zeros_like(n)
  s = max(max_share, 1.0 / active.sum())
  lo, hi = 0.0, 1.0 / n[active].min()
  for _ in range(200):
    c = 0.5 * (lo + hi)
    if np.minimum(s, c * n).sum() < 1.0:
      lo = c
    else:
      hi = c
  return np.minimum(s, hi * n)


def clip_updates_ref(params, reference, max_norm) -> dict:
  """`r + min(1, c / ||w_i - r||) (w_i - r)` per client."""
  norms = update_norms_ref(params, reference)
  factor = np.minimum(1.0, max_norm / np.maximum(norms, 1e-300))
  return jax.tree.map(
      lambda x, r: np.asarray(r, np.float64)[None] + factor.reshape(
          (-1,) + (1,) * (np.ndim(x) - 1)) * (np.asarray(x, np.float64)
                                             - np.asarray(r, np.float64)[None]),
      params, reference)


def model_contrastive_ref(z, z_glob, z_prev, temperature, mask=None):
  """MOON's `l_con` (Eq. 3), a loop over the valid samples: `-log(e^(s_g / tau) /
  (e^(s_g / tau) + e^(s_p / tau)))` with cosine similarities `s_g`, `s_p`."""
  mask = np.ones(len(z), bool) if mask is None else np.asarray(mask, bool)
  cos = lambda a, b: float(a @ b) / (np.linalg.norm(a) * np.linalg.norm(b))
  terms = []
  for a, g, p, valid in zip(*(np.asarray(v, np.float64) for v in (z, z_glob, z_prev)),
                            mask):
    if valid:
      pos, neg = np.exp(cos(a, g) / temperature), np.exp(cos(a, p) / temperature)
      terms.append(-np.log(pos / (pos + neg)))
  return sum(terms) / max(len(terms), 1)


def ala_ref(weights, local, global_model):
  """FedALA's aggregated layer (Eq. 5): `local + (global - local) * W`."""
  return jax.tree.map(
      lambda w, l, g: np.asarray(l, np.float64)
      + (np.asarray(g, np.float64) - np.asarray(l, np.float64)) * np.asarray(w),
      weights, local, global_model)


# ---------------------------------------- Byzantine-robust rules (issue 32)


def _flat64(params, mask=None):
  """`(n, d)` float64 rows of the participating clients, and their indices."""
  rows = flat_clients(params).astype(np.float64)
  keep = np.arange(rows.shape[0]) if mask is None else np.flatnonzero(mask)
  return rows[keep], keep


def krum_scores_ref(rows: np.ndarray, f: int) -> np.ndarray:
  """Blanchard et al. 2017, Eq. 2: each row's sum of squared distances to its
  n - f - 2 nearest other rows (at least one)."""
  n = rows.shape[0]
  k = max(n - f - 2, 1)
  scores = []
  for i in range(n):
    d = sorted(float(np.sum((rows[i] - rows[j]) ** 2)) for j in range(n) if j != i)
    scores.append(sum(d[:k]))
  return np.array(scores)


def krum_order_ref(rows: np.ndarray, f: int) -> np.ndarray:
  """Rows by Krum score; equal scores by the sum of all distances, then index."""
  total = np.array([sum(float(np.sum((r - s) ** 2)) for s in rows) for r in rows])
  return np.lexsort((np.arange(rows.shape[0]), total, krum_scores_ref(rows, f)))


def multi_krum_ref(params, f, m, mask=None):
  """The mean of the m rows of lowest Krum score."""
  rows, _ = _flat64(params, mask)
  best = krum_order_ref(rows, f)[:m]
  return _unflat(params, rows[best].mean(axis=0))


def bulyan_ref(params, f, mask=None):
  """El Mhamdi et al. 2018, Algorithm 1: theta = n - 2f rows chosen one by one
  by Krum among those left; per coordinate the mean of the beta = theta - 2f
  chosen values closest to their median."""
  rows, _ = _flat64(params, mask)
  n = rows.shape[0]
  theta, left, chosen = n - 2 * f, list(range(n)), []
  for _ in range(theta):
    chosen.append(left.pop(int(krum_order_ref(rows[left], f)[0])))
  s = rows[chosen]
  beta = theta - 2 * f
  med = np.median(s, axis=0)
  order = np.argsort(np.abs(s - med), axis=0, kind="stable")
  return _unflat(params, np.take_along_axis(s, order, axis=0)[:beta].mean(axis=0))


def geometric_median_ref(params, alphas=None, nu=1e-6, iterations=3, mask=None):
  """Pillutla et al. 2022, Algorithm 2 (smoothed Weiszfeld) from the weighted mean."""
  rows, keep = _flat64(params, mask)
  a = np.ones(rows.shape[0]) if alphas is None else np.asarray(alphas, np.float64)[keep]
  a = a / a.sum()
  v = a @ rows
  for _ in range(iterations):
    beta = a / np.maximum(nu, np.linalg.norm(rows - v, axis=1))
    v = (beta / beta.sum()) @ rows
  return _unflat(params, v)


def centered_clipping_ref(params, center, tau, iterations=1, mask=None):
  """Karimireddy et al. 2021, Eq. 4: v <- v + mean_i (x_i - v) min(1, tau/||x_i - v||)."""
  rows, _ = _flat64(params, mask)
  v = np.concatenate([np.ravel(c).astype(np.float64) for c in leaves(center)])
  for _ in range(iterations):
    d = rows - v
    norm = np.linalg.norm(d, axis=1)
    factor = np.minimum(1.0, tau / np.maximum(norm, 1e-300))
    v = v + (factor[:, None] * d).mean(axis=0)
  return _unflat(params, v)


def _unflat(params, vector):
  """A flat float64 vector back into `params`'s structure without the client axis."""
  out, start = [], 0
  for x in leaves(params):
    size = int(np.prod(x.shape[1:]))
    out.append(vector[start:start + size].reshape(x.shape[1:]))
    start += size
  return unflatten_like(params, out)
