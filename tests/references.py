"""Plain NumPy references for pflax.aggregate, written from the papers' equations.

Everything here loops over clients and classes in float64 and never calls pflax,
so a test comparing pflax to these functions can fail independently of pflax's
own choices. Settled points follow /work/shared/SPEC.md (cited per function).
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
  """`(p_i, p_ij, q_ij)` of cwFedAvg Eq. (5)-(6) with SPEC 2.2's settled cases."""
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
  """FedDWA Eq. (3)-(6) as settled in SPEC 2.4 (softmax over k != i, self alpha)."""
  s = cosine_matrix(flat_clients(params) - flat_clients(received))
  m = s.shape[0]
  if m == 1:
    return np.ones((1, 1))
  beta = np.zeros((m, m))
  for i in range(m):
    denom = sum(np.exp(s[i, k] / temperature) for k in range(m) if k != i)
    for j in range(m):
      beta[i, j] = alpha if j == i else (1 - alpha) * np.exp(s[i, j] / temperature) / denom
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
  """FedReMa Eq. (5): cosine similarity of soft logits, diagonal 1."""
  s = cosine_matrix(np.asarray(soft, np.float64))
  np.fill_diagonal(s, 1.0)
  return s


def mds_ref(s_row):
  """SPEC 2.5's settled MDS: stable ascending sort, drop the top gap, cut at the
  first largest remaining gap, select every client above the cut."""
  s = np.asarray(s_row, np.float64)
  m = len(s)
  if m <= 2:
    return np.ones(m, bool), 0.0
  order = sorted(range(m), key=lambda i: s[i])      # Python's sort is stable
  gaps = [s[order[t + 1]] - s[order[t]] for t in range(m - 2)]   # top gap excluded
  cut = max(range(len(gaps)), key=lambda t: (gaps[t], -t))       # first maximum
  selected = np.zeros(m, bool)
  for t in range(cut + 1, m):
    selected[order[t]] = True
  return selected, gaps[cut]


def fedrema_ref(params, num_samples, soft, dependency, max_gap, in_ccp, delta=0.5):
  """One FedReMa server round (Eq. 6-10, Algorithms 1-2), SPEC 2.5.

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
  """SPEC 2.6 step 5 with exact rational similarities.

  Pairs are ranked by similarity, then lowest `(a, b)`; joins by similarity, then
  lowest `(cluster, client)`.
  """
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
    if links[best] > sim_threshold:
      clusters[best].append(c)
  return clusters


def fedsa_leaf_ref(w, num_samples=None, cv_threshold=0.2, num_mic=4, num_mac=4,
                   sim_threshold=0.2, ddof=1):
  """SPEC 2.6 steps 1-7 on one leaf, `w` of shape `(M, ...)`."""
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
