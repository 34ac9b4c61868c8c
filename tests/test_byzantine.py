"""The Byzantine-robust rules of issue 32 (Krum, Multi-Krum, Bulyan, the geometric
median, centered clipping): float64 NumPy references written from the papers
(tests/references.py), hypothesis properties, the bound on f, and bad inputs."""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pflax import aggregate as agg
from pflax import algorithms
from pflax import models
from pflax import privacy
from pflax import simulate

import references as ref

TRANSFORMS = [pytest.param(jax.jit, id="jit"), pytest.param(ref.no_jit, id="nojit")]
"""Each reference test runs under `jit` and without (the property tests, slow, do
both through the public functions, which run their own jitted programs)."""
MASK = np.array([True, True, False, True, True, True, True, True, False, True, True])


def _params(seed, m=11):
  return ref.random_params(np.random.default_rng(seed), m)


def _with_outliers(params, rows, scale=1e3):
  """`params` with the clients `rows` moved far away (Byzantine uploads)."""
  def move(x):
    x = np.array(x)
    x[rows] = x[rows] * scale + scale
    return x
  return jax.tree.map(move, params)


# ------------------------------------------------------------- references


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("mask", [None, MASK])
@pytest.mark.parametrize("f,m", [(0, 1), (2, 4), (3, 2)])
def test_multi_krum_matches_reference(transform, mask, f, m):
  params = _with_outliers(_params(f), [0, 5])
  out = transform(lambda p: agg.multi_krum(p, num_byzantine=f, num_selected=m,
                                           mask=mask))(params)
  ref.assert_tree_close(out, ref.multi_krum_ref(params, f, m, mask), rtol=1e-4,
                        atol=1e-4)


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("mask", [None, MASK])
@pytest.mark.parametrize("f", [0, 1, 2])
def test_bulyan_matches_reference(transform, mask, f):
  params = _with_outliers(_params(10 + f), [3] if f else [])
  m = 11 if mask is None else int(mask.sum())
  if m < 4 * f + 3:
    pytest.skip("outside Bulyan's bound")
  out = transform(lambda p: agg.bulyan(p, num_byzantine=f, mask=mask))(params)
  ref.assert_tree_close(out, ref.bulyan_ref(params, f, mask), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("mask", [None, MASK])
@pytest.mark.parametrize("iterations", [0, 3, 20])
def test_geometric_median_matches_reference(transform, mask, iterations):
  params = _with_outliers(_params(20), [1, 2])
  counts = np.arange(1.0, 12.0)
  out = transform(lambda p, n: agg.geometric_median(
      p, n, iterations=iterations, mask=mask))(params, counts)
  ref.assert_tree_close(
      out, ref.geometric_median_ref(params, counts, iterations=iterations, mask=mask),
      rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("mask", [None, MASK])
@pytest.mark.parametrize("tau,iterations", [(0.5, 1), (3.0, 5), (np.inf, 1)])
def test_centered_clipping_matches_reference(transform, mask, tau, iterations):
  params = _with_outliers(_params(30), [4])
  center = jax.tree.map(lambda x: np.asarray(x[6]) * 0.5, params)
  out = transform(lambda p, c: agg.centered_clipping(
      p, c, radius=tau, iterations=iterations, mask=mask))(params, center)
  ref.assert_tree_close(
      out, ref.centered_clipping_ref(params, center, tau, iterations, mask),
      rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------- properties

_SEEDS = st.integers(0, 2**31 - 1)


@pytest.mark.slow
@hypothesis.given(seed=_SEEDS, f=st.integers(0, 2), scale=st.sampled_from([1e-3, 1.0, 1e4]))
@hypothesis.settings(max_examples=10, deadline=None)
def test_rules_are_permutation_invariant(seed, f, scale):
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda x: x * scale, ref.random_params(rng, 11))
  perm = rng.permutation(11)
  permuted = jax.tree.map(lambda x: x[perm], params)
  center = jax.tree.map(lambda x: np.zeros(x.shape[1:], x.dtype), params)
  rules = [lambda p: agg.multi_krum(p, num_byzantine=f, num_selected=3),
           lambda p: agg.bulyan(p, num_byzantine=f),
           lambda p: agg.geometric_median(p),
           lambda p: agg.centered_clipping(p, center, radius=scale)]
  for rule in rules:
    ref.assert_tree_close(rule(permuted), rule(params), rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.slow
@hypothesis.given(seed=_SEEDS, m=st.integers(3, 9))
@hypothesis.settings(max_examples=10, deadline=None)
def test_rules_equal_the_mean_without_byzantine_clients(seed, m):
  """Multi-Krum with m = n, f = 0 and centered clipping with tau = inf are the
  mean (Blanchard et al., Section 5; Karimireddy et al., Eq. 4)."""
  params = ref.random_params(np.random.default_rng(seed), m)
  mean = ref.fedavg_ref(params)
  ref.assert_tree_close(agg.multi_krum(params, num_byzantine=0, num_selected=m), mean)
  center = jax.tree.map(lambda x: np.asarray(x[0]), params)
  ref.assert_tree_close(agg.centered_clipping(params, center, radius=np.inf), mean)


@pytest.mark.slow
@hypothesis.given(seed=_SEEDS, m=st.integers(3, 7))
@hypothesis.settings(max_examples=8, deadline=None)
def test_identical_clients_give_their_model(seed, m):
  one = ref.random_params(np.random.default_rng(seed), 1)
  params = jax.tree.map(lambda x: np.repeat(x, m, axis=0), one)
  model = jax.tree.map(lambda x: x[0], one)
  ref.assert_tree_close(agg.geometric_median(params, iterations=5), model)
  ref.assert_tree_close(agg.bulyan(params, num_byzantine=(m - 3) // 4), model)
  ref.assert_tree_close(agg.krum(params, num_byzantine=max((m - 3) // 2, 0)), model)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_dtypes_are_kept(dtype):
  if dtype == np.float64 and not jax.config.jax_enable_x64:
    dtype = jnp.bfloat16
  params = jax.tree.map(lambda x: jnp.asarray(x, dtype), _params(3))
  center = jax.tree.map(lambda x: x[0], params)
  for out in (agg.krum(params, num_byzantine=2), agg.bulyan(params, num_byzantine=2),
              agg.geometric_median(params), agg.centered_clipping(params, center, radius=1.0)):
    assert {x.dtype for x in jax.tree.leaves(out)} == {jnp.dtype(dtype)}


def test_byzantine_minority_does_not_move_the_rules():
  """f far-away clients (1e30, NaN) change no rule's choice among the honest."""
  honest = _params(40, 8)
  bad = jax.tree.map(lambda x: np.concatenate([x, np.full((3,) + x.shape[1:], 1e30, x.dtype)]),
                     honest)
  bad_nan = jax.tree.map(lambda x: np.concatenate([x, np.full((3,) + x.shape[1:], np.nan, x.dtype)]),
                         honest)
  for params in (bad, bad_nan):
    # The 8 honest clients' n - f - 2 = 6 nearest are honest: their Krum
    # scores are those of the honest clients alone with f = 0.
    out = agg.multi_krum(params, num_byzantine=3, num_selected=4)
    ref.assert_tree_close(out, ref.multi_krum_ref(honest, 0, 4), rtol=1e-4, atol=1e-4)
    for x in jax.tree.leaves(agg.bulyan(params, num_byzantine=2)):
      assert np.all(np.isfinite(x)) and np.max(np.abs(x)) < 10


def test_masked_nonfinite_clients_are_ignored():
  params = _params(50)
  mask = MASK.copy()
  poisoned = jax.tree.map(lambda x: np.where(ref.leaves({"m": ~mask})[0].astype(bool).reshape(
      (-1,) + (1,) * (x.ndim - 1)), np.nan, x), params)
  center = jax.tree.map(lambda x: np.zeros(x.shape[1:], x.dtype), params)
  for rule in (lambda p: agg.krum(p, num_byzantine=2, mask=mask),
               lambda p: agg.bulyan(p, num_byzantine=1, mask=mask),
               lambda p: agg.geometric_median(p, mask=mask),
               lambda p: agg.centered_clipping(p, center, radius=1.0, mask=mask)):
    ref.assert_tree_close(rule(poisoned), rule(params))


# -------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("call,message", [
    (lambda p: agg.krum(p, num_byzantine=5), r"Krum with num_byzantine f = 5 needs n > 2f \+ 2"),
    (lambda p: agg.krum(p, num_byzantine=4, mask=MASK), r"at least 11\), got 9"),
    (lambda p: agg.multi_krum(p, num_byzantine=1, num_selected=12), "num_selected must be at most"),
    (lambda p: agg.multi_krum(p, num_byzantine=1, num_selected=0), "num_selected must be >= 1"),
    (lambda p: agg.bulyan(p, num_byzantine=3), r"Bulyan with num_byzantine f = 3 needs n >= 4f \+ 3"),
    (lambda p: agg.krum(p, num_byzantine=-1), "num_byzantine must be >= 0"),
    (lambda p: agg.geometric_median(p, smoothing=0.0), "smoothing must be"),
    (lambda p: agg.geometric_median(p, np.ones(3)), r"num_samples.*\(M,\)"),
    (lambda p: agg.geometric_median(p, -np.ones(11)), "num_samples"),
    (lambda p: agg.centered_clipping(p, jax.tree.map(lambda x: x, p), radius=1.0),
     "center: every leaf must have the shape"),
    (lambda p: agg.centered_clipping(p, jax.tree.map(lambda x: x[0], p), radius=0.0),
     "radius must be"),
    (lambda p: agg.krum(p, num_byzantine=0, mask=np.zeros(11, bool)), "mask is all False"),
])
def test_bad_inputs_are_one_line_errors(call, message):
  with pytest.raises(ValueError, match=message):
    call(_params(60))


# ------------------------------------- the shared parts of personalized methods


SHARED_PART_METHODS = ("fedper", "fedrep", "ditto", "fedbabu", "fedavg_ft",
                       "fedclassavg")
"""The personalized methods whose shared part takes a robust rule (docs/robustness.md)."""


def _after_a_round_with_one_liar(name, **keywords):
  """Every client's models after one round where clients 0-3 upload their start
  models + 1 and client 4 its start + 1e6: `(start, handed out)`, rows 0-3."""
  model = models.MLP(3, hidden=(4,))
  shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 5)))["params"]
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: jnp.asarray(
      np.broadcast_to(rng.normal(size=s.shape), (5, *s.shape)), jnp.float32), shapes)
  counts = jnp.asarray([[2, 1, 1], [1, 3, 0], [0, 2, 2], [3, 0, 1], [4, 4, 4]],
                       jnp.int32)
  algorithm = algorithms.METHODS[name].builder(
      model, simulate.client_optimizer("sgd", 0.1), **keywords)
  state = algorithm.init(params, counts, jax.random.key(1))
  start = algorithm.client_models(state)
  trained = jax.tree.map(lambda x: x + jnp.where(
      jnp.arange(5).reshape((-1,) + (1,) * (x.ndim - 1)) == 4, 1e6, 1.0), start)
  state = algorithm.server_update(state, trained, jnp.ones(5, bool), jax.random.key(2))
  rows = lambda tree: [np.asarray(x)[:4] for x in jax.tree.leaves(tree)]
  return rows(start), rows(algorithm.client_models(state))


@pytest.mark.parametrize("name", SHARED_PART_METHODS)
def test_the_shared_part_of_a_personalized_method_takes_the_robust_rule(name):
  start, mean = _after_a_round_with_one_liar(name)
  _, median = _after_a_round_with_one_liar(name, robust="median")
  # The sample-weighted mean lets the liar (a third of the samples) pull the
  # shared part by about 3e5; the median hands out the honest clients' value.
  assert max(np.abs(m - s).max() for m, s in zip(mean, start)) > 1e4
  for m, s in zip(median, start):
    np.testing.assert_array_less(np.abs(m - s), 1.0 + 1e-4)


@pytest.mark.parametrize("name", SHARED_PART_METHODS)
def test_robust_shared_parts_are_refused_under_dp_and_checked(name):
  build = lambda **kw: algorithms.METHODS[name].builder(
      models.MLP(3), simulate.client_optimizer("sgd", 0.1), **kw)
  robust = build(robust="krum", num_byzantine=1)
  assert "robust" in privacy.not_covered(robust, None)
  with pytest.raises(ValueError, match="robust must be one of"):
    build(robust="mean")
  with pytest.raises(ValueError, match="radius"):
    build(robust="centered_clipping", radius=0.0)
  config = simulate.ExperimentConfig(clients=6, rounds=1, model="mlp", hyperparameters={
      name: {"robust": "bulyan", "num_byzantine": 1}})
  with pytest.raises(ValueError, match="needs at least 7 participants"):
    simulate.run(name, config, 0)   # refused before any data or compilation
