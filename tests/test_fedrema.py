"""FedReMa pieces (soft logits, relevance, MDS, rounds) against loop references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pflax import aggregate as agg

import references as ref
TRANSFORMS = [pytest.param(ref.no_jit, id="nojit"), pytest.param(jax.jit, id="jit")]
assert_tree_close = ref.assert_tree_close


def _soft(rng, m, c=5, temperature=0.5):
  return ref.soft_logits_ref(rng.normal(size=(m, c)) * 2, temperature).astype(np.float32)


def _state(dependency, max_gap, in_ccp):
  return agg.FedReMaState(jnp.asarray(dependency, jnp.int32),
                          jnp.asarray(max_gap, jnp.float32), jnp.asarray(in_ccp))


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_soft_logits(transform, temperature):
  logits = np.random.default_rng(0).normal(size=(3, 7)).astype(np.float32) * 4
  out = transform(functools.partial(agg.soft_logits, temperature=temperature))(logits)
  assert out.shape == (3, 7) and out.dtype == jnp.float32
  np.testing.assert_allclose(out, ref.soft_logits_ref(logits, temperature), rtol=1e-5,
                             atol=1e-7)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_relevance(transform):
  soft = _soft(np.random.default_rng(1), 6)
  soft[2] = soft[4]                                  # identical soft logits
  out = transform(agg.relevance)(soft)
  np.testing.assert_allclose(out, ref.relevance_ref(soft), atol=1e-6)
  np.testing.assert_array_equal(np.diagonal(out), np.ones(6))   # exactly 1
  assert np.all((out >= 0) & (out <= 1 + 1e-6))


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_probe_logits_share_one_uniform_probe(transform):
  rng = np.random.default_rng(2)
  f = c = 6
  kernel = rng.normal(size=(4, f, c)).astype(np.float32)
  bias = rng.normal(size=(4, c)).astype(np.float32)
  kernel[0], bias[0] = np.eye(f), 0.0                # client 0 reveals the probe
  params = {"kernel": kernel, "bias": bias}
  apply_fn = lambda p, h: h @ p["kernel"] + p["bias"]
  fn = transform(functools.partial(agg.probe_logits, apply_fn, feature_dim=f))
  logits = np.asarray(fn(params, jax.random.key(0)), np.float64)
  assert logits.shape == (4, c)
  probe = logits[0]
  assert np.all((probe >= 0) & (probe < 1)) and np.ptp(probe) > 0
  for k in range(4):
    np.testing.assert_allclose(logits[k], probe @ kernel[k] + bias[k], rtol=1e-5,
                               atol=1e-5)
  other = np.asarray(fn(params, jax.random.key(1)))
  assert not np.allclose(other[0], probe)
  np.testing.assert_array_equal(fn(params, jax.random.key(0)), logits.astype(np.float32))


def _relevance_rows(seed, m, count):
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(count):
    s = ref.relevance_ref(_soft(rng, m))
    rows.append(s[rng.integers(m)])
  return np.array(rows, np.float32)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_mds_matches_settled_rule(m):
  rows = _relevance_rows(m, m, 40)
  selected, gaps = jax.jit(jax.vmap(agg.mds))(rows)
  assert selected.shape == (40, m) and selected.dtype == jnp.bool_
  for row, sel, gap in zip(rows, selected, gaps):
    exp_sel, exp_gap = ref.mds_ref(row)
    np.testing.assert_array_equal(sel, exp_sel)
    np.testing.assert_allclose(gap, exp_gap, atol=1e-6)
    # The client itself (the entry 1) and at least one peer are always selected.
    assert sel[np.argmax(row)] and (m == 1 or sel.sum() >= 2)
  if m == 4:
    sel, gap = agg.mds(rows[0])                     # without jit
    np.testing.assert_array_equal(sel, ref.mds_ref(rows[0])[0])
    np.testing.assert_allclose(gap, ref.mds_ref(rows[0])[1], atol=1e-6)


def test_mds_hand_example():
  # sorted: .1 .2 .6 .65 1 -> gaps .1 .4 .05 (top gap .35 excluded) -> cut at .4.
  sel, gap = agg.mds(np.array([0.6, 1.0, 0.1, 0.65, 0.2]))
  np.testing.assert_array_equal(sel, [True, True, False, True, False])
  np.testing.assert_allclose(gap, 0.4, rtol=1e-6)
  # The largest gap is the top one: it is excluded, so a peer is still selected.
  sel, gap = agg.mds(np.array([1.0, 0.1, 0.15, 0.11]))
  np.testing.assert_array_equal(sel, [True, False, True, False])
  np.testing.assert_allclose(gap, 0.04, rtol=1e-5)
  sel, gap = agg.mds(np.array([1.0, 0.3]))
  np.testing.assert_array_equal(sel, [True, True])
  assert float(gap) == 0.0


def test_mds_equal_peers_are_selected_together():
  # With every peer equally similar all remaining gaps are 0. SPEC 2.5's rule
  # by sorted position would drop the first peer of the stable sort; pflax
  # resolves ties by value (documented in `mds`'s Notes) and keeps all of them,
  # which is what a client-order-independent rule must do.
  sel, gap = agg.mds(np.array([0.5, 1.0, 0.5, 0.5]))
  np.testing.assert_array_equal(sel, [True, True, True, True])
  assert float(gap) == 0.0


@pytest.mark.parametrize("transform,m,weighted", ref.sweep(
    [(2, True), (3, True), (6, False)], [(4, True), (4, False)]))
def test_fedrema_ccp_round_matches_reference(transform, m, weighted):
  rng = np.random.default_rng(m + 10 * weighted)
  params = ref.random_params(rng, m)
  n = rng.integers(1, 30, size=m) if weighted else None
  soft = _soft(rng, m)
  state = agg.fedrema_init(m)
  out, new = transform(agg.fedrema)(params, n, soft, state)
  exp, dep, max_gap, in_ccp = ref.fedrema_ref(params, n, soft, np.zeros((m, m)), 0.0,
                                              True)
  assert_tree_close(out, exp)
  np.testing.assert_array_equal(new.dependency, dep)
  assert new.dependency.dtype == jnp.int32
  np.testing.assert_allclose(new.max_gap, max_gap, atol=1e-6)
  assert bool(new.in_ccp) == in_ccp
  # The feature extractor is the n-weighted FedAvg in every client.
  fedavg = ref.fedavg_ref(params, n)
  for i in range(m):
    np.testing.assert_allclose(out["features"]["conv"][i], fedavg["features"]["conv"],
                               rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("transform,in_ccp", ref.sweep([False, True], [False]))
def test_fedrema_from_given_state(transform, in_ccp, m=4):
  rng = np.random.default_rng(7)
  params = ref.random_params(rng, m)
  n = rng.integers(1, 30, size=m)
  soft = _soft(rng, m)
  dependency = rng.integers(0, 4, size=(m, m)) + np.eye(m, dtype=int)
  state = _state(dependency, 10.0, in_ccp)         # large max_gap: CCP ends now
  fn = transform(lambda p, n, s, st, d: agg.fedrema(p, n, s, st, delta=d))
  out, new = fn(params, n, soft, state, 0.3)
  exp, dep, max_gap, exp_ccp = ref.fedrema_ref(params, n, soft, dependency, 10.0,
                                               in_ccp, delta=0.3)
  assert_tree_close(out, exp)
  np.testing.assert_array_equal(new.dependency, dep)
  np.testing.assert_allclose(new.max_gap, max_gap, atol=1e-6)
  assert not bool(new.in_ccp) and not exp_ccp
  if not in_ccp:                                    # history branch: Eq. (10)
    np.testing.assert_array_equal(new.dependency, dependency)
    w = dependency / dependency.sum(axis=1, keepdims=True)
    bias = params["classifier"]["output"]["bias"].astype(np.float64)
    np.testing.assert_allclose(out["classifier"]["output"]["bias"], w @ bias,
                               rtol=2e-5, atol=2e-5)


def _grouped_soft(rng, m, spread):
  """Two groups of clients favouring different classes; `spread` sets the gap."""
  logits = rng.normal(size=(m, 4)) * 0.05
  logits[: m // 2, 0] += spread
  logits[m // 2:, 1] += spread
  return ref.soft_logits_ref(logits, 0.5).astype(np.float32)


def test_fedrema_ccp_switch_is_one_way_over_rounds(m=4):
  rng = np.random.default_rng(8)
  n = rng.integers(1, 30, size=m)
  step = jax.jit(agg.fedrema)
  state = agg.fedrema_init(m)
  ref_state = (np.zeros((m, m), int), 0.0, True)
  flags = []
  for spread in (3.0, 0.05, 3.0, 5.0):              # gap shrinks, then grows again
    params = ref.random_params(rng, m)
    soft = _grouped_soft(rng, m, spread)
    out, state = step(params, n, soft, state)
    exp, *ref_state = ref.fedrema_ref(params, n, soft, *ref_state)
    assert_tree_close(out, exp)
    np.testing.assert_array_equal(state.dependency, ref_state[0])
    np.testing.assert_allclose(state.max_gap, ref_state[1], rtol=1e-5)
    assert bool(state.in_ccp) == ref_state[2]
    flags.append(bool(state.in_ccp))
  assert flags == [True, False, False, False]
  # After the CCP, the history and the max gap are frozen.
  frozen = state
  _, state = step(ref.random_params(rng, m), n, _grouped_soft(rng, m, 9.0), frozen)
  np.testing.assert_array_equal(state.dependency, frozen.dependency)
  assert float(state.max_gap) == float(frozen.max_gap) and not bool(state.in_ccp)
