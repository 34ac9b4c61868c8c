"""FedSA: the worked examples of docs/methods.md#fedsa and a loop reference of steps 1-7.

FedSA compiles a clustering loop per leaf, so these tests share a few compiled
functions (hyperparameters that may be traced are passed as arguments).
"""

import functools
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pflax import aggregate as agg
from pflax._src.aggregators import fedsa as fedsa_lib

import references as ref

EXAMPLE_1 = np.array([[1.00, -2.0, 0.50, 0.10, -0.50, 0.30],
                      [1.02, -2.1, 0.55, 0.12, -0.45, 0.50],
                      [0.98, -1.9, 0.45, 0.14, -1.30, 0.80],
                      [1.00, -2.0, 0.60, 0.90, -1.00, 0.00]], np.float32)
EXAMPLE_2 = np.array([[.10, .20, .15, .10, .20, .10],
                      [.20, .10, .10, .25, .10, .15],
                      [.15, .25, .20, .20, .40, .60],
                      [.90, .80, .90, .40, .90, .90],
                      [.80, .90, .60, .60, .55, .80],
                      [.40, .60, .40, .90, .60, .20],
                      [.60, .55, .35, .15, .80, .40]], np.float32)


@functools.lru_cache(maxsize=None)
def _jitted(**static):
  """One compiled FedSA per set of static hyperparameters."""
  return jax.jit(lambda params, n, sim, cv: agg.fedsa(
      params, n, sim_threshold=sim, cv_threshold=cv, **static))


def _fedsa(params, n=None, sim_threshold=0.2, cv_threshold=0.2, **static):
  if n is None:
    n = np.ones(jax.tree.leaves(params)[0].shape[0], np.float32)
  return _jitted(**static)(params, n, sim_threshold, cv_threshold)


def test_example_1():
  w = {"w": EXAMPLE_1}
  np.testing.assert_allclose(_fedsa(w, num_mac=1)["w"],
                             [1.0, -2.0, 0.525, 0.12, -0.75, 0.533333], atol=1e-5)
  np.testing.assert_allclose(_fedsa(w, np.array([1, 2, 3, 4]), num_mac=1)["w"],
                             [0.998, -1.99, 0.535, 0.12, -0.75, 0.533333], atol=1e-5)


def test_example_2():
  w = {"w": EXAMPLE_2}
  np.testing.assert_allclose(
      _fedsa(w, num_mac=3)["w"],
      [0.5, 0.536111, 0.425, 0.383333, 0.616667, 0.403333], atol=1e-5)
  np.testing.assert_allclose(
      _fedsa(w, num_mac=2)["w"],
      [0.5, 0.516667, 0.45, 0.341667, 0.479167, 0.566667], atol=1e-5)
  np.testing.assert_allclose(
      _fedsa(w, sim_threshold=0.1, num_mac=2)["w"],
      [0.57, 0.595, 0.495, 0.41, 0.5725, 0.57], atol=1e-5)


def _data(rng, m, size):
  """Positions of low and high dispersion; clients in 3 latent groups."""
  mu = rng.choice([-1, 1], size) * rng.uniform(0.5, 2, size)
  groups = rng.integers(0, 3, m)
  offsets = rng.normal(size=(3, size))
  scale = rng.choice([0.02, 1.0], size)
  noise = offsets[groups] + 0.4 * rng.normal(size=(m, size))
  return (mu + scale * noise * np.abs(mu)).astype(np.float32)


SIZE = 11
CONFIGS = [
    (1, {}),
    (2, {}),
    (5, dict(num_mac=2, num_mic=3, ddof=0)),
    (8, dict(num_mac=2, num_mic=5)),
]


@pytest.mark.parametrize("m,static", CONFIGS)
def test_random_data_matches_reference(m, static):
  rng = np.random.default_rng(m)
  for trial in range(8):
    w = _data(rng, m, SIZE)
    n = rng.integers(1, 20, size=m).astype(np.float32)
    sim = float(rng.choice([0.2, 0.1, 0.35]))
    cv = float(rng.choice([0.2, 0.5]))
    out = np.asarray(_fedsa({"w": w}, n, sim, cv, **static)["w"])
    expected = ref.fedsa_leaf_ref(w, n, cv_threshold=cv, sim_threshold=sim, **static)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5,
                               err_msg=f"trial {trial}")
    if m == 1:
      np.testing.assert_array_equal(out, w[0])
  # Every position of low dispersion: plain weighted FedAvg.
  w = (1.0 + 0.01 * rng.normal(size=(m, SIZE))).astype(np.float32)
  out = _fedsa({"w": w}, n, 0.2, 0.2, **static)["w"]
  np.testing.assert_allclose(out, ref.fedsa_leaf_ref(w, n, **static), rtol=1e-6)
  np.testing.assert_allclose(out, n @ w / n.sum(), rtol=1e-6)


def test_per_leaf_with_odd_shapes():
  rng = np.random.default_rng(11)
  params = {"a": _data(rng, 5, 15).reshape(5, 3, 5),
            "b": _data(rng, 5, 24).reshape(5, 2, 3, 4)}
  n = rng.integers(1, 9, size=5).astype(np.float32)
  out = _fedsa(params, n, 0.2, num_mac=2)
  for name in params:
    assert out[name].shape == params[name].shape[1:]
    np.testing.assert_allclose(
        out[name], ref.fedsa_leaf_ref(params[name], n, num_mac=2), rtol=1e-5,
        atol=1e-5)


def test_join_pair_tie_is_decided_exactly():
  # Regression: here a cluster of three ties with the best free pair (q* = p* =
  # 2/7 in exact arithmetic); the reconstruction (docs/methods.md#fedsa) joins on ties, float rounding of the
  # averaged fractions used to open a new pair instead.
  rng = np.random.default_rng(66)
  m, size = int(rng.integers(1, 9)), int(rng.integers(1, 12))
  mu = rng.choice([-1, 1], size) * rng.uniform(0.2, 2, size)
  scale = rng.choice([0.01, 0.5, 2.0], size)
  w = (mu + scale * rng.normal(size=(m, size)) * np.abs(mu)).astype(np.float32)
  n = np.ones(m, np.float32)
  assert w.shape == (8, SIZE)               # shares the compiled CONFIGS[-1]
  out = _fedsa({"w": w}, n, 0.2, num_mac=2, num_mic=5)["w"]
  np.testing.assert_allclose(
      out, ref.fedsa_leaf_ref(w, n, num_mac=2, num_mic=5), rtol=1e-5, atol=1e-5)


@functools.lru_cache(maxsize=None)
def _macro_classes(num_mac):
  return jax.jit(lambda sim, valid, threshold, num_high: fedsa_lib.macro_classes(
      sim, valid, num_mac, threshold, num_high))


@pytest.mark.parametrize("num_mac", [1, 3, 6])
def test_clustering_matches_reference_with_ties_and_mask(num_mac):
  # Step 5 alone at M = 40 (larger than the leaf tests reach): agreement
  # counts out of |H| = 5 tie often, so the lowest-index rules decide.
  rng = np.random.default_rng(num_mac)
  m, num_high = 40, 5
  for trial in range(4):
    counts = rng.integers(0, num_high + 1, (m, m))
    counts = np.triu(counts, 1) + np.triu(counts, 1).T + num_high * np.eye(m, dtype=int)
    valid = rng.random(m) > 0.2 if trial % 2 else np.ones(m, bool)
    threshold = float(rng.choice([0.1, 0.5]))
    kept = np.flatnonzero(valid)
    sim = [[Fraction(int(counts[a, b]), num_high) for b in kept] for a in kept]
    expected = np.full(m, -1)
    for g, cluster in enumerate(ref.fedsa_clusters(sim, num_mac, threshold)):
      expected[kept[cluster]] = g
    out = _macro_classes(num_mac)(counts.astype(np.int32), valid, threshold,
                                  np.int32(num_high))
    np.testing.assert_array_equal(out, expected, err_msg=f"trial {trial}")


def _clusters(counts, num_high, num_mac, threshold):
  """Expected step 5 from the exact reference (every client valid)."""
  sim = [[Fraction(int(x), num_high) for x in row] for row in counts]
  expected = np.full(len(counts), -1)
  for g, cluster in enumerate(ref.fedsa_clusters(sim, num_mac, threshold)):
    expected[cluster] = g
  return expected


def test_issue_11_ties_between_cluster_sizes():
  # Issue 11 item 3: the late client [0,0,1,1,2] agrees on 1 of 5 positions
  # with every member of both clusters: linkages 5/25 and 4/20 tie, so it
  # joins the first cluster (docs/methods.md#fedsa). Float rounding sent it to the second.
  w = np.array([[0, 3, 0, 3, 0]] * 5 + [[3, 0, 3, 0, 3]] * 4 + [[0, 0, 1, 1, 2]] * 3,
               np.float32)
  expected = [1.5, 0.9375, 1.6875, 1.125, 1.875]   # (5 A + 7 B) / 12 mixed by votes
  np.testing.assert_allclose(ref.fedsa_leaf_ref(w, num_mac=2, sim_threshold=0.1),
                             expected, rtol=1e-12)
  np.testing.assert_allclose(agg.fedsa({"w": w}, num_mac=2, sim_threshold=0.1)["w"],
                             expected, rtol=1e-6)


_H = 2 ** 25   # agreement counts above 2^24: float32 sums and ratios round


def _sizes_tie_counts():
  """Clusters {0,1,2} and {3,4}; client 5 links to them by a + 1/3 and a + 1/2."""
  a = _H // 2 + 2
  c = np.zeros((8, 8), np.int64)
  c[np.ix_([0, 1, 2], [0, 1, 2])] = _H
  c[np.ix_([3, 4], [3, 4])] = _H
  c[5, [0, 1, 2]] = [a, a, a + 1]
  c[5, [3, 4]] = [a, a + 1]
  c[6, 7] = 1
  return np.maximum(c, c.T)


def _join_pair_counts():
  """Cluster {0,1}; client 2 links to it by k - 1/2, the free pair (3,4) has k."""
  k = _H // 2 + 4
  c = np.zeros((5, 5), np.int64)
  c[0, 1], c[0, 2], c[1, 2], c[3, 4] = _H, k - 1, k, k
  c = np.maximum(c, c.T)
  np.fill_diagonal(c, _H)
  return c


@pytest.mark.parametrize("counts,num_mac,threshold,expected", [
    # Late client 5 joins the cluster of size 2 (a + 1/2 > a + 1/3).
    (_sizes_tie_counts(), 2, 0.1, [0, 0, 0, 1, 1, 1, -1, -1]),
    # The same comparison inside the loop: 5 joins cluster 1, then 6-7 pair up.
    (_sizes_tie_counts(), 3, 0.1, [0, 0, 0, 1, 1, 1, 2, 2]),
    # q* = k - 1/2 < p* = k: the pair opens cluster 1; client 2 (linkage ~0.5)
    # stays unclustered at threshold 0.6. Rounded, q* == p* and 2 joined.
    (_join_pair_counts(), 2, 0.6, [0, 0, -1, 1, 1]),
])
def test_linkages_are_compared_exactly(counts, num_mac, threshold, expected):
  np.testing.assert_array_equal(_clusters(counts, _H, num_mac, threshold), expected)
  out = _macro_classes(num_mac)(counts.astype(np.int32), np.ones(len(counts), bool),
                                threshold, np.int32(_H))
  np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("num_high,row,threshold", [
    (5, [5, 4], 0.9), (10, [10, 3], 0.65), (10, [5, 4], 0.45), (5, [1, 1], 0.2)])
def test_linkage_equal_to_threshold_is_not_above(num_high, row, threshold):
  # Cluster {0, 1}; the late client 2's linkage sum(row) / (2 |H|) equals the
  # threshold as a decimal, so it must stay unclustered (float32 0.9 rounds
  # below 9/10, and a rounded 9/10 compared above it).
  counts = np.full((3, 3), num_high)
  counts[2, :2] = counts[:2, 2] = row
  assert Fraction(sum(row), 2 * num_high) == Fraction(str(threshold))
  out = _macro_classes(1)(counts.astype(np.int32), np.ones(3, bool), threshold,
                          np.int32(num_high))
  np.testing.assert_array_equal(out, [0, 0, -1])
  np.testing.assert_array_equal(_clusters(counts, num_high, 1, threshold), [0, 0, -1])


def test_cv_exactly_at_threshold_is_low_dispersion():
  # ddof=0, two clients: mu = 1 and sigma = d exactly, so cv = d = tau in float32
  # (1 + 1e-12 rounds to 1). Position 0 has cv = 0.25 = tau: low, so the
  # n-weighted FedAvg (1 * 0.75 + 3 * 1.25) / 4 = 1.125; position 1 has
  # cv = 0.3 > tau: high, the single cluster's unweighted mean 1.0.
  w = np.array([[0.75, 0.7], [1.25, 1.3]], np.float32)
  out = agg.fedsa({"w": w}, np.array([1.0, 3.0]), cv_threshold=0.25, ddof=0)["w"]
  np.testing.assert_array_equal(out, [1.125, 1.0])


@pytest.mark.parametrize("example,scale", [
    (EXAMPLE_1, 1e19), (EXAMPLE_2, 1e30), (EXAMPLE_2, 3e38), (EXAMPLE_2, 1e-30)])
def test_large_and_small_magnitudes(example, scale):
  # Issue 11 item 5: the variance used to overflow (every position fell back to
  # FedAvg). The statistics are scale invariant, so the result scales too.
  w = (example.astype(np.float64) * scale).astype(np.float32)
  assert np.all(np.isfinite(w))
  num_mac = 1 if example is EXAMPLE_1 else 3
  out = np.asarray(agg.fedsa({"w": w}, num_mac=num_mac)["w"], np.float64)
  np.testing.assert_allclose(out, ref.fedsa_leaf_ref(w, num_mac=num_mac), rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_precision_inputs(dtype):
  # Statistics in float32 on the upcast leaf, result cast back.
  w = jnp.asarray(EXAMPLE_2 * 100, dtype)
  out = agg.fedsa({"w": w}, num_mac=3)["w"]
  assert out.dtype == dtype
  exact = agg.fedsa({"w": w.astype(jnp.float32)}, num_mac=3)["w"]
  np.testing.assert_array_equal(out, exact.astype(dtype))
  np.testing.assert_allclose(np.asarray(out, np.float64),
                             ref.fedsa_leaf_ref(w.astype(jnp.float32), num_mac=3),
                             rtol=1e-2)


def test_float64_under_x64():
  with jax.enable_x64(True):
    for scale in (1.0, 1e200):          # squares of 1e200 overflow float64
      w = EXAMPLE_2.astype(np.float64) * scale
      n = np.array([1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 5.0])   # weights k / 17
      out = agg.fedsa({"w": jnp.asarray(w)}, n, num_mac=3)["w"]
      assert out.dtype == jnp.float64
      expected = ref.fedsa_leaf_ref(EXAMPLE_2.astype(np.float64), n, num_mac=3) * scale
      np.testing.assert_allclose(out, expected, rtol=1e-12)


def test_no_weight():
  w = {"w": EXAMPLE_2}
  with pytest.raises(ValueError, match="mask"):
    agg.fedsa(w, mask=np.zeros(7, bool))
  with pytest.raises(ValueError, match="num_samples"):
    agg.fedsa(w, np.zeros(7), mask=np.ones(7, bool))
  # Traced: the documented finite result, zeros (one compilation for both).
  fn = jax.jit(lambda p, n, m: agg.fedsa(p, n, mask=m))
  for n, mask in ((np.ones(7), np.zeros(7, bool)), (np.zeros(7), np.ones(7, bool))):
    np.testing.assert_array_equal(fn(w, n, mask)["w"], np.zeros(6))


def test_complex_params_are_refused():
  # Issue 11 item 6: complex leaves used to fail inside jnp.floor.
  with pytest.raises(TypeError, match="params.*'w'"):
    agg.fedsa({"w": np.ones((3, 2), np.complex64)})


def test_counts_that_would_overflow_int32_are_refused():
  # Shapes only (eval_shape allocates nothing): M max(M, n) >= 2^31.
  big = {"w": jax.ShapeDtypeStruct((2, 2 ** 30), jnp.float32)}
  with pytest.raises(ValueError, match="2\\*\\*31"):
    jax.eval_shape(agg.fedsa, big)
  jax.eval_shape(agg.fedsa, {"w": jax.ShapeDtypeStruct((2, 2 ** 30 - 1), jnp.float32)})


def test_eager_calls_reuse_one_compilation():
  # Issue 11 item 17: eager calls run one jitted implementation; new values of
  # the traced hyperparameters and of the mask do not recompile.
  params = {"w": np.random.default_rng(3).normal(size=(6, 3)).astype(np.float32)}
  before = fedsa_lib._fedsa._cache_size()
  for cv, sim, mask in ((0.2, 0.2, [True] * 6), (0.5, 0.1, [True, False] * 3)):
    agg.fedsa(params, np.arange(1.0, 7.0), num_mac=2, cv_threshold=cv,
              sim_threshold=sim, mask=np.array(mask))
  assert fedsa_lib._fedsa._cache_size() - before == 1
