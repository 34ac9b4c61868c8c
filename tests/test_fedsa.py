"""FedSA: the worked examples of SPEC 2.6 and a loop reference of steps 1-7.

FedSA compiles a clustering loop per leaf, so these tests share a few compiled
functions (hyperparameters that may be traced are passed as arguments).
"""

import functools
from fractions import Fraction

import jax
import numpy as np
import pytest

from pflax import aggregate as agg
from pflax._src import fedsa as fedsa_lib

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
  # 2/7 in exact arithmetic); SPEC 2.6 joins on ties, float rounding of the
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
    out = _macro_classes(num_mac)(counts.astype(np.float32), valid, threshold,
                                  np.float32(num_high))
    np.testing.assert_array_equal(out, expected, err_msg=f"trial {trial}")
