"""One conformance harness run on every aggregator (like optax's contrib/_common_test).

Each case wraps an aggregator as `fn(params, stats, mask) -> (params_out, extra)`,
where `stats` holds the per-client statistics and `extra` any returned state. A
case's `stat_axes` / `extra_axes` name the client axes of those pytrees, so the
checks can permute clients or take a subset of them generically.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pflax import aggregate as agg
from pflax import tree as ptree

import references as ref

M, K = 4, 3
MASK = np.array([True, False, True, True])
KEEP = np.flatnonzero(MASK)
PERM = np.array([2, 0, 3, 1])


def _params(rng, m):
  return {
      "features": {"w": rng.normal(size=(m, 2, 3)).astype(np.float32)},
      "classifier": {"output": {
          "kernel": rng.normal(size=(m, 3, 5)).astype(np.float32)}},
  }


def _fedsa_params(rng, m):
  """One leaf with clearly separated groups, so the clustering has no ties that
  depend on client order."""
  groups = np.arange(m) % 2
  centers = rng.choice([-1.0, 1.0], size=(2, 6)) * rng.uniform(0.5, 2.0, size=(2, 6))
  w = centers[groups] + 0.01 * rng.normal(size=(m, 6))
  return {"w": w.astype(np.float32)}


def _counts(rng, m):
  c = rng.integers(0, 8, size=(m, K))
  c[:, 0] += 1
  return c.astype(np.float32)


def _soft(rng, m):
  return ref.soft_logits_ref(rng.normal(size=(m, 5)) * 2, 0.5).astype(np.float32)


def _history_state(rng, m):
  dep = rng.integers(0, 5, size=(m, m)) + np.eye(m, dtype=int)
  return agg.FedReMaState(dep.astype(np.int32), np.float32(0.3), np.bool_(False))


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  fn: Callable[..., tuple[Any, Any]]
  make_stats: Callable[[np.random.Generator, int, Any], dict]
  personal: bool
  make_params: Callable = _params
  stat_axes: Callable[[dict], Any] = lambda stats: jax.tree.map(lambda _: (0,), stats)
  extra_axes: Any = None
  # Leaves a masked client keeps; the others are broadcast to every client (FedReMa
  # sends its averaged feature extractor to all clients, Alg. 2 line 19).
  masked_keeps: Any = None

  def __repr__(self):
    return self.name


_STATE_AXES = agg.FedReMaState((0, 1), (), ())


def _fedrema_axes(stats):
  return {"n": (0,), "soft": (0,), "state": _STATE_AXES}


def _fedrema(p, s, mask):
  return agg.fedrema(p, s["n"], s["soft"], s["state"], mask=mask)


CASES = [
    Case("fedavg",
         lambda p, s, mask: (agg.fedavg(p, s["n"], mask=mask), None),
         lambda rng, m, p: {"n": rng.integers(1, 9, m).astype(np.float32)},
         personal=False),
    Case("cw_fedavg_counts",
         lambda p, s, mask: (agg.cw_fedavg(p, s["counts"], mask=mask), None),
         lambda rng, m, p: {"counts": _counts(rng, m)}, personal=True),
    Case("cw_fedavg_dist_where",
         lambda p, s, mask: (agg.cw_fedavg(p, s["dist"], s["n"], mask=mask,
                                           where=ptree.under("classifier")), None),
         lambda rng, m, p: {"dist": rng.uniform(size=(m, K)).astype(np.float32),
                            "n": rng.integers(1, 9, m).astype(np.float32)},
         personal=True),
    Case("class_models",
         lambda p, s, mask: (agg.class_models(p, s["counts"], mask=mask), None),
         lambda rng, m, p: {"counts": _counts(rng, m)}, personal=False),
    Case("fedclassavg",
         lambda p, s, mask: (agg.fedclassavg(p, s["n"], mask=mask), None),
         lambda rng, m, p: {"n": rng.integers(1, 9, m).astype(np.float32)},
         personal=True),
    Case("feddwa",
         lambda p, s, mask: (agg.feddwa(p, s["received"], mask=mask), None),
         lambda rng, m, p: {"received": jax.tree.map(
             lambda x: (x + rng.normal(size=x.shape) * 0.5).astype(x.dtype), p)},
         personal=True),
    Case("fedrema_ccp", _fedrema,
         lambda rng, m, p: {"n": rng.integers(1, 9, m).astype(np.float32),
                            "soft": _soft(rng, m), "state": agg.fedrema_init(m)},
         personal=True, stat_axes=_fedrema_axes, extra_axes=_STATE_AXES,
         masked_keeps=ptree.under("classifier")),
    Case("fedrema_history", _fedrema,
         lambda rng, m, p: {"n": rng.integers(1, 9, m).astype(np.float32),
                            "soft": _soft(rng, m), "state": _history_state(rng, m)},
         personal=True, stat_axes=_fedrema_axes, extra_axes=_STATE_AXES,
         masked_keeps=ptree.under("classifier")),
    Case("fedsa",
         lambda p, s, mask: (agg.fedsa(p, num_mac=2, mask=mask), None),
         lambda rng, m, p: {}, personal=False, make_params=_fedsa_params),
    Case("median",
         lambda p, s, mask: (agg.median(p, mask=mask), None),
         lambda rng, m, p: {}, personal=False),
    Case("trimmed_mean",
         lambda p, s, mask: (agg.trimmed_mean(p, trim_fraction=0.25, mask=mask), None),
         lambda rng, m, p: {}, personal=False),
    Case("fedavg_capped",
         lambda p, s, mask: (agg.fedavg(p, agg.capped_weights(s["n"], 0.3, mask=mask),
                                        mask=mask), None),
         lambda rng, m, p: {"n": rng.integers(1, 9, m).astype(np.float32)},
         personal=False),
]
CASE_PARAMS = [pytest.param(c, id=c.name) for c in CASES]


# ------------------------------------------------------------------- helpers


_TRACES = {}


def _jit(case: Case):
  """The jitted aggregator, shared by every check (compiled once per shape)."""
  return _jit_fn(case.fn)


@functools.lru_cache(maxsize=None)
def _jit_fn(fn):
  """`jax.jit(fn)` that counts its traces in `_TRACES[fn]`."""
  def traced(*args):
    _TRACES[fn] = _TRACES.get(fn, 0) + 1
    return fn(*args)

  return jax.jit(traced)


def _inputs(case: Case, seed: int = 0, m: int = M):
  rng = np.random.default_rng(seed)
  params = case.make_params(rng, m)
  return params, case.make_stats(rng, m, params)


def _is_axes(x):
  return isinstance(x, tuple) and all(isinstance(a, int) for a in x)


def _take(tree, axes, idx):
  """Indexes every leaf of `tree` with `idx` along each of its client axes."""
  def one(ax, x):
    x = np.asarray(x)
    for a in ax:
      x = np.take(x, idx, axis=a)
    return x
  return jax.tree.map(one, axes, tree, is_leaf=_is_axes)


def _take_params(tree, idx):
  return jax.tree.map(lambda x: np.asarray(x)[idx], tree)


def _assert_close(actual, expected, rtol=1e-5, atol=1e-5):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    assert np.shape(a) == np.shape(e)
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(e, np.float64),
                               rtol=rtol, atol=atol)


def _shapes(tree):
  return [np.shape(x) for x in jax.tree.leaves(tree)]


def _out_leaves(out):
  return jax.tree.leaves(out[0])


# -------------------------------------------------------------------- checks


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_jit_matches_no_jit(case):
  params, stats = _inputs(case)
  eager = case.fn(params, stats, None)
  jitted = _jit(case)(params, stats, None)
  _assert_close(jitted, eager)
  shapes = [np.shape(x) for x in jax.tree.leaves(params)]
  out_shapes = [np.shape(x) for x in _out_leaves(eager)]
  if case.personal:
    assert out_shapes == shapes
  elif case.name == "class_models":
    assert out_shapes == [(K,) + s[1:] for s in shapes]
  else:
    assert out_shapes == [s[1:] for s in shapes]


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_vmap_over_seeds_matches_loop(case):
  seeds = [_inputs(case, seed) for seed in range(3)]
  batched = jax.tree.map(lambda *xs: np.stack(xs), *seeds)
  out = jax.jit(jax.vmap(case.fn, in_axes=(0, 0, None)))(*batched, None)
  for s, (params, stats) in enumerate(seeds):
    _assert_close(jax.tree.map(lambda x: x[s], out), _jit(case)(params, stats, None))


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_client_permutation_equivariance(case):
  params, stats = _inputs(case)
  out = _jit(case)(params, stats, None)
  permuted = _jit(case)(_take_params(params, PERM),
                        _take(stats, case.stat_axes(stats), PERM), None)
  if case.personal:
    _assert_close(permuted[0], _take_params(out[0], PERM))
  else:
    _assert_close(permuted[0], out[0])
  if case.extra_axes is not None:
    _assert_close(permuted[1], _take(out[1], case.extra_axes, PERM))


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_mixing_rows_sum_to_one(case):
  params, stats = _inputs(case)
  ones = jax.tree.map(np.ones_like, params)
  for leaf in _out_leaves(_jit(case)(ones, stats, None)):
    np.testing.assert_allclose(leaf, 1.0, rtol=1e-6)


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_bfloat16_in_bfloat16_out(case):
  params, stats = _inputs(case)
  low = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), params)
  if "received" in stats:
    stats = {"received": jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16),
                                      stats["received"])}
  out = _jit(case)(low, stats, None)
  for leaf in _out_leaves(out):
    assert leaf.dtype == jnp.bfloat16
  upcast = lambda t: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), t)
  exact = _jit(case)(upcast(low), upcast(stats) if "received" in stats else stats,
                     None)
  _assert_close(out[0], exact[0], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_mask_equals_unmasked_subset(case):
  params, stats = _inputs(case)
  masked = _jit(case)(params, stats, jnp.asarray(MASK))
  subset = _jit(case)(_take_params(params, KEEP),
                      _take(stats, case.stat_axes(stats), KEEP), None)
  assert _shapes(masked) == _shapes(_jit(case)(params, stats, None))
  if case.personal:
    _assert_close(_take_params(masked[0], KEEP), subset[0])
    for new, old, sub in zip(jax.tree_util.tree_leaves_with_path(masked[0]),
                             jax.tree.leaves(params), jax.tree.leaves(subset[0])):
      path, new = new
      kept = case.masked_keeps is None or case.masked_keeps(
          tuple(getattr(k, "key", str(k)) for k in path), new)
      expected = old[~MASK] if kept else np.broadcast_to(sub[0], old[~MASK].shape)
      np.testing.assert_array_equal(np.asarray(new)[~MASK], expected)
  else:
    _assert_close(masked[0], subset[0])
  if case.extra_axes is not None:
    _assert_close(_take(masked[1], case.extra_axes, KEEP), subset[1])
    dep, old = np.asarray(masked[1].dependency), stats["state"].dependency
    np.testing.assert_array_equal(dep[~MASK], np.asarray(old)[~MASK])
    np.testing.assert_array_equal(dep[:, ~MASK], np.asarray(old)[:, ~MASK])


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_masked_nonfinite_client_does_not_leak(case):
  params, stats = _inputs(case)
  clean = _jit(case)(params, stats, jnp.asarray(MASK))
  bad = jax.tree.map(np.copy, params)
  for i, leaf in enumerate(jax.tree.leaves(bad)):
    leaf[1] = np.nan if i % 2 == 0 else np.inf
  if "received" in stats:
    stats = {"received": jax.tree.map(lambda x: np.asarray(x).copy(), stats["received"])}
    for leaf in jax.tree.leaves(stats["received"]):
      leaf[1] = np.nan
  if "soft" in stats:
    stats = dict(stats, soft=stats["soft"].copy())
    stats["soft"][1] = np.nan
  jitted = _jit(case)
  out = jitted(bad, stats, jnp.asarray(MASK))
  traces = _TRACES[case.fn]
  if case.personal:
    _assert_close(_take_params(out[0], KEEP), _take_params(clean[0], KEEP))
  else:
    _assert_close(out[0], clean[0])
  for leaf in jax.tree.leaves(out[0]):
    rows = np.asarray(leaf, np.float32)[KEEP] if case.personal else leaf
    assert np.all(np.isfinite(rows))
  # Another mask value reuses the same trace (the mask never changes shapes).
  other = jitted(bad, stats, jnp.asarray([True, False, False, True]))
  assert _shapes(other) == _shapes(out)
  assert _TRACES[case.fn] == traces


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_gradient_is_finite(case):
  params, stats = _inputs(case)

  def loss(p):
    return sum(jnp.sum(jnp.square(x)) for x in _out_leaves(case.fn(p, stats, None)))

  grads = jax.jit(jax.grad(loss))(params)
  assert jax.tree.structure(grads) == jax.tree.structure(params)
  for g in jax.tree.leaves(grads):
    assert np.all(np.isfinite(g))
  assert any(np.any(g != 0) for g in jax.tree.leaves(grads))
