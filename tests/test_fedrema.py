"""FedReMa pieces (soft logits, relevance, MDS, rounds) against loop references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pflax import aggregate as agg
from pflax import tree as ptree

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
  # With every peer equally similar all remaining gaps are 0. The settled MDS rule (docs/methods.md#fedrema)
  # by sorted position would drop the first peer of the stable sort; pflax
  # resolves ties by value (documented in `mds`'s Notes; `ref.mds_ref` follows
  # it) and keeps all of them, as a client-order-independent rule must.
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


def test_identical_soft_logits_select_every_client():
  # Issue 11 item 1: in float32 the cosines of identical rows are 1.0000001;
  # the client itself (diagonal 1) ranked below its peers and was dropped:
  # classifiers [4.5, 3, 1.5] and a zero diagonal in `dependency`. Each client
  # must select all three (mean 3), and a gap of rounding noise (1e-7) must
  # not keep the CCP alive: gap 0, max_gap 0, CCP over.
  soft = jnp.tile(jnp.asarray([[0.2086123, 0.2417693, 0.5496184]]), (3, 1))
  s = agg.relevance(soft)
  assert np.all(np.asarray(s) == 1.0)
  params = {"classifier": {"w": jnp.asarray([[0.0], [3.0], [6.0]])}}
  out, state = agg.fedrema(params, jnp.ones(3), soft, agg.fedrema_init(3))
  np.testing.assert_array_equal(out["classifier"]["w"], [[3.0], [3.0], [3.0]])
  np.testing.assert_array_equal(state.dependency, np.ones((3, 3)))
  assert float(state.max_gap) == 0.0 and not bool(state.in_ccp)


def test_relevance_is_within_unit_interval_with_self_on_top():
  rng = np.random.default_rng(4)
  soft = _soft(rng, 6, c=3)
  soft[3] = soft[1] = soft[0] = [0.2086123, 0.2417693, 0.5496184]  # cosines 1 + 1e-7
  s = np.asarray(agg.relevance(soft))
  assert np.all((s >= 0) & (s <= 1))
  np.testing.assert_array_equal(np.diagonal(s), np.ones(6))
  np.testing.assert_array_equal(s.max(axis=1), np.ones(6))


def test_mds_rounding_decides_nothing():
  # The client itself (the entry 1) with two peers rounded above it: all three.
  sel, gap = agg.mds(np.array([1.0, 1.0000001, 1.0000001], np.float32))
  np.testing.assert_array_equal(sel, [True, True, True])
  assert float(gap) == 0.0
  # Gaps 0.3 and 0.3 tie (the first, lower one is cut): in float32 the upper
  # one is 0.30000001 and the lower 0.29999999, which cut at the upper one.
  sel, gap = agg.mds(np.array([1.0, 0.8, 0.5, 0.2], np.float32))
  np.testing.assert_array_equal(sel, [True, True, True, False])
  np.testing.assert_allclose(gap, 0.3, rtol=1e-6)
  np.testing.assert_array_equal(ref.mds_ref([1.0, 0.8, 0.5, 0.2])[0],
                                [True, True, True, False])
  # Peers equal up to rounding are selected together.
  sel, _ = agg.mds(np.array([0.2, 1.0, 0.5000001, 0.4999999, 0.5], np.float32))
  np.testing.assert_array_equal(sel, [False, True, True, True, True])


def _one_hot_soft():
  """Clients {0, 1} and {2, 3} predict different classes: every gap is 1."""
  return np.array([[1, 0], [1, 0], [0, 1], [0, 1]], np.float32)


@pytest.mark.parametrize("max_gap,delta,in_ccp", [
    (2.0, 0.5, True),          # gap_bar = 1 = delta * max_gap exactly
    (0.0, 1.0, True),          # first round: max_gap = gap_bar = 1, delta 1
    (2.0, 0.5000001, False),   # just above the boundary
])
def test_ccp_boundary_is_inclusive(max_gap, delta, in_ccp):
  # docs/methods.md#fedrema: the CCP continues while gap_bar >= delta * max_gap.
  params = ref.random_params(np.random.default_rng(5), 4)
  state = _state(np.zeros((4, 4)), max_gap, True)
  _, new = agg.fedrema(params, None, _one_hot_soft(), state, delta=delta)
  assert float(new.max_gap) == max(max_gap, 1.0)
  assert bool(new.in_ccp) == in_ccp
  np.testing.assert_array_equal(new.dependency, np.kron(np.eye(2), np.ones((2, 2))))


def test_masked_clients_receive_the_feature_extractor():
  # Issue 11 item 9 (Alg. 2, line 19; docs/methods.md#fedrema): every client receives theta;
  # masked clients keep only their own classifier.
  rng = np.random.default_rng(6)
  params = ref.random_params(rng, 4)
  params["classifier"]["output"]["bias"][1] = np.nan      # a faulty client
  n = np.array([3.0, 5.0, 1.0, 2.0])
  mask = np.array([True, False, True, True])
  out, _ = agg.fedrema(params, n, _soft(rng, 4), agg.fedrema_init(4), mask=mask)
  keep = np.flatnonzero(mask)
  theta = ref.fedavg_ref(jax.tree.map(lambda x: x[keep], params), n[keep])
  for name in ("conv", "dense"):
    for i in range(4):
      np.testing.assert_allclose(out["features"][name][i], theta["features"][name],
                                 rtol=2e-5, atol=2e-5)
  for name in ("kernel", "bias"):
    np.testing.assert_array_equal(out["classifier"]["output"][name][1],
                                  params["classifier"]["output"][name][1])


def test_no_client_with_weight():
  params = ref.random_params(np.random.default_rng(7), 3)
  soft, state = _soft(np.random.default_rng(7), 3), agg.fedrema_init(3)
  with pytest.raises(ValueError, match="mask"):
    agg.fedrema(params, None, soft, state, mask=np.zeros(3, bool))
  with pytest.raises(ValueError, match="num_samples"):
    agg.fedrema(params, np.zeros(3), soft, state)
  # Traced: params and state unchanged (an empty round ends no CCP).
  state = _state(np.ones((3, 3)), 0.4, True)
  fn = jax.jit(lambda p, n, m: agg.fedrema(p, n, soft, state, mask=m))
  for n, mask in ((np.ones(3), np.zeros(3, bool)), (np.zeros(3), np.ones(3, bool))):
    out, new = fn(params, n, mask)
    assert_tree_close(out, params, rtol=0, atol=0)
    for a, b in zip(new, state):
      np.testing.assert_array_equal(a, b)


M_BAD = 3
P_BAD = ref.random_params(np.random.default_rng(8), M_BAD)
SOFT_BAD = np.full((M_BAD, 4), 0.25, np.float32)


@pytest.mark.parametrize("state,error,pattern", [
    (agg.FedReMaState(jnp.zeros((3, 3), jnp.float32), jnp.float32(0), jnp.bool_(True)),
     TypeError, "state.dependency.*int32"),
    (agg.FedReMaState(jnp.zeros((3, 3), jnp.int32), jnp.zeros(3), jnp.bool_(True)),
     ValueError, r"state.max_gap.*\(\)"),
    (agg.FedReMaState(jnp.zeros((3, 3), jnp.int32), jnp.int32(0), jnp.bool_(True)),
     TypeError, "state.max_gap.*float32"),
    (agg.FedReMaState(jnp.zeros((3, 3), jnp.int32), jnp.float32(0), jnp.ones(3, bool)),
     ValueError, "state.in_ccp"),
    (agg.FedReMaState(jnp.zeros((3, 3), jnp.int32), jnp.float32(0), jnp.float32(1)),
     TypeError, "state.in_ccp.*bool"),
    (agg.FedReMaState(-jnp.ones((3, 3), jnp.int32), jnp.float32(0), jnp.bool_(True)),
     ValueError, "state.dependency.*non-negative"),
    (agg.FedReMaState(jnp.zeros((3, 3), jnp.int32), jnp.float32(np.nan),
                      jnp.bool_(True)), ValueError, "state.max_gap.*finite"),
    ((jnp.zeros((3, 3), jnp.int32), jnp.float32(0), jnp.bool_(True)),
     TypeError, "FedReMaState"),
])
def test_malformed_state_is_refused(state, error, pattern):
  with pytest.raises(error, match=pattern):
    agg.fedrema(P_BAD, None, SOFT_BAD, state)


@pytest.mark.parametrize("value", [np.nan, -0.1, np.inf])
def test_soft_must_be_probabilities_for_unmasked_clients(value):
  soft = SOFT_BAD.copy()
  soft[1, 2] = value
  with pytest.raises(ValueError, match=r"soft.*\[1\]"):
    agg.fedrema(P_BAD, None, soft, agg.fedrema_init(M_BAD))
  # A masked client's row may be anything.
  out, _ = agg.fedrema(P_BAD, None, soft, agg.fedrema_init(M_BAD),
                       mask=np.array([True, False, True]))
  assert all(np.all(np.isfinite(np.asarray(x)[[0, 2]])) for x in jax.tree.leaves(out))


def test_default_where_on_a_plain_flax_cnn_is_an_error():
  # Issue 11 item 15: Flax names a plain CNN's modules Conv_0, Dense_0, ...; the
  # default under("classifier") would personalize nothing.
  rng = np.random.default_rng(9)
  params = {"Conv_0": {"kernel": rng.normal(size=(3, 3, 3, 1, 4)).astype(np.float32)},
            "Dense_0": {"kernel": rng.normal(size=(3, 8, 5)).astype(np.float32)},
            "Dense_1": {"kernel": rng.normal(size=(3, 5, 2)).astype(np.float32)}}
  with pytest.raises(ValueError, match="where.*Dense_1"):
    agg.fedrema(params, None, SOFT_BAD, agg.fedrema_init(3))
  out, _ = agg.fedrema(params, None, SOFT_BAD, agg.fedrema_init(3),
                       where=ptree.under("Dense_1"))
  assert jax.tree.structure(out) == jax.tree.structure(params)


def test_eager_calls_reuse_one_compilation():
  # Issue 11 item 17: eager calls run module-level jitted implementations.
  from pflax._src.aggregators import fedrema as rema_lib
  rng = np.random.default_rng(10)
  params, n = ref.random_params(rng, 5), rng.integers(1, 9, 5).astype(np.float32)
  sizes = [f._cache_size() for f in (rema_lib._fedrema, rema_lib._relevance,
                                     rema_lib._mds_all, rema_lib._soft_logits)]
  for delta, temperature in ((0.5, 0.5), (0.3, 2.0)):
    soft = agg.soft_logits(rng.normal(size=(5, 4)), temperature)
    agg.mds(agg.relevance(soft)[0])
    agg.fedrema(params, n, soft, agg.fedrema_init(5), delta=delta,
                mask=np.array([True, True, False, True, True]))
  new = [f._cache_size() for f in (rema_lib._fedrema, rema_lib._relevance,
                                   rema_lib._mds_all, rema_lib._soft_logits)]
  assert [b - a for a, b in zip(sizes, new)] == [1, 1, 1, 1]


def test_soft_logits_of_huge_logits_at_low_temperature_are_finite():
  """`z / T` overflows float32 for z = 1e30, T = 0.05 (it gave NaN under jit)."""
  logits = np.array([[1e30, 1e30, 1e30], [1e30, -1e30, 0.0]], np.float32)
  soft = np.asarray(jax.jit(agg.soft_logits)(logits, 0.05))
  np.testing.assert_allclose(soft, [[1 / 3] * 3, [1.0, 0.0, 0.0]], rtol=1e-6)
