"""Property-based tests (hypothesis) of every aggregator (issue 11, "Tests").

Hostile inputs over M (1..8), K (1..6), leaf ranks 0..3 in nested dicts, dtypes
(float16, bfloat16, float32; float64 under `jax.enable_x64`), magnitudes from
1e-6 to 1e30 (float16: up to 4e4), masks whose masked-out clients upload
NaN/inf, and ties (repeated rows, identical clients, integer-valued params).
Oracle: the float64 loop references of `references.py`.

The properties are the contract (docs/methods.md, issue 11, the boundary API), never
today's behaviour. Cases whose answer depends on how float rounding breaks a
near-tie (a similarity gap, a coefficient of variation at the threshold) are
skipped with `assume`: the reference cannot say which side is right there.

Budget: the "pflax" hypothesis profile (tests/conftest.py) runs a few fixed
examples per property; `HYPOTHESIS_PROFILE=ci` searches far more. Every call
goes through one `jax.jit` per aggregator (and static hyperparameters), always
with a mask array, so examples of the same shape share one compilation.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import hypothesis
from hypothesis import assume
from hypothesis import given
from hypothesis import settings
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pflax import aggregate as agg
from pflax import tree as ptree

import references as ref
import strategies as sts

_EXAMPLES = settings.default.max_examples


def budget(weight: float = 1.0):
  """Examples for one property: `weight` times the profile's budget."""
  return settings(max_examples=max(2, round(_EXAMPLES * weight)))


@pytest.fixture(autouse=True, scope="module")
def _release_executables():
  """Frees this module's compiled executables when it is done.

  Every XLA-CPU executable maps memory; a wide search compiles thousands of
  them, enough to reach Linux's `vm.max_map_count` (65530), where the next
  compilation segfaults. The wide profile also frees them after every test.
  """
  yield
  _jitted.cache_clear()
  jax.clear_caches()


@pytest.fixture(autouse=True)
def _release_executables_when_wide():
  yield
  if sts.WIDE:
    _jitted.cache_clear()
    jax.clear_caches()


# ------------------------------------------------------------------ helpers


def _f64(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def _is_axes(x):
  return isinstance(x, tuple) and all(isinstance(a, int) for a in x)


def _take_leaf(x, axes, idx):
  if not axes:
    return x
  x = np.asarray(x)
  for a in axes:
    x = np.take(x, idx, axis=a)
  return x


def _take(tree, axes, idx):
  """Indexes every leaf of `tree` with `idx` along its client axes (`axes`
  is a prefix of `tree` whose leaves are tuples of axes)."""
  return jax.tree.map(
      lambda ax, sub: jax.tree.map(lambda x: _take_leaf(x, ax, idx), sub),
      axes, tree, is_leaf=_is_axes)


def _rows(tree, idx):
  return jax.tree.map(lambda x: np.asarray(x)[idx], tree)


def _unit(dtype) -> float:
  return float(jnp.finfo(dtype).eps) / 2


def _tolerance(dtype, scale: float, terms: float) -> float:
  """Absolute tolerance of a convex mix of values up to `scale`: rounding to
  the output dtype plus `terms` roundings in the accumulation dtype, plus the
  accumulation dtype's smallest normal (XLA-CPU flushes subnormals to zero)."""
  acc = jnp.promote_types(dtype, jnp.float32)
  return (scale * (2 * _unit(dtype) + 16 * terms * _unit(acc))
          + 4 * float(jnp.finfo(acc).tiny))


def _scales(params, valid) -> list[float]:
  """Per leaf: the largest |value| over valid clients (float64)."""
  return [float(np.max(np.abs(x[valid]), initial=0.0))
          for x in jax.tree.leaves(_f64(params))]


def _size(params) -> int:
  return sum(int(np.prod(np.shape(x)[1:])) for x in jax.tree.leaves(params))


def _assert_close(actual, expected, atols, what=""):
  assert jax.tree.structure(actual) == jax.tree.structure(expected), what
  for (path, a), e, atol in zip(jax.tree_util.tree_leaves_with_path(actual),
                                jax.tree.leaves(expected), atols):
    assert np.shape(a) == np.shape(e), (what, path, np.shape(a), np.shape(e))
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(e, np.float64),
                               rtol=0, atol=atol,
                               err_msg=f"{what} {jax.tree_util.keystr(path)}")


def _assert_dtypes(out, params):
  for o, p in zip(jax.tree.leaves(out), jax.tree.leaves(params)):
    assert o.dtype == p.dtype, (o.dtype, p.dtype)


def _embed(sub, full, keep):
  """`full` with rows `keep` replaced by `sub` (personalized results)."""
  def one(s, f):
    out = np.array(f, np.float64, copy=True)
    out[keep] = s
    return out
  return jax.tree.map(one, sub, full)


# ------------------------------------------------------- aggregator table


@dataclasses.dataclass(frozen=True)
class Agg:
  """One aggregator under test.

  `make(statics)` returns `fn(params, stats, mask)` (jit-able), whose
  parameter output `pick` extracts; `reference(params, stats, statics)`
  computes that in float64 on the valid clients only (or, with
  `full_reference`, from the full inputs and the mask, masked rows
  included). `output` is "personal" (M rows), "global" (no client axis) or
  "classes" (K rows).
  """
  name: str
  make: Callable[[Any], Callable]
  draw_stats: Callable
  reference: Callable
  output: str
  axes: Callable[[dict], Any]
  counts: tuple[str, ...] = ()
  spoiled: tuple[str, ...] = ()
  statics: tuple = (None,)
  layouts: tuple[str, ...] = ("flat", "nested")
  dyadic: bool = False
  full_reference: bool = False
  masked_kept: Callable[[tuple], bool] = lambda path: True
  decided: Callable | None = None
  terms: Callable[[int, dict, int], float] = lambda m, stats, size: m + 8
  pick: Callable[[Any], Any] = lambda out: out


def _n_axes(stats):
  return {k: (0,) for k in stats}


def _draw_n(draw, m, params, valid, dtype):
  return {"n": sts.counts(draw, m, valid)}


def _draw_counts(draw, m, params, valid, dtype):
  k = draw(sts.num_classes(), label="K")
  return {"counts": sts.class_counts(draw, m, k, valid)}


def _draw_dist(draw, m, params, valid, dtype):
  k = draw(sts.num_classes(), label="K")
  dist = draw(hnp.arrays(np.float64, (m, k), elements=st.floats(0, 1)))
  return {"dist": dist.astype(np.float32), "n": sts.counts(draw, m, valid)}


def _cw_terms(m, stats, size):
  k = next(v.shape[1] for key, v in stats.items() if key in ("counts", "dist"))
  return 2 * (m + k) + 8


FEDSA_STATICS = ((4, 2, 1), (2, 1, 1), (4, 3, 0))   # (num_mic, num_mac, ddof)


def _draw_fedsa(draw, m, params, valid, dtype):
  return {"n": sts.counts(draw, m, valid),
          "cv": draw(st.sampled_from([0.2, 0.05, 1.0]), label="cv_threshold"),
          "sim": draw(st.sampled_from([0.2, 0.1, 0.5]), label="sim_threshold")}


def _fedsa_make(statics):
  num_mic, num_mac, ddof = statics
  return lambda p, s, mask: agg.fedsa(p, s["n"], cv_threshold=s["cv"],
                                      sim_threshold=s["sim"], num_mic=num_mic,
                                      num_mac=num_mac, ddof=ddof, mask=mask)


def _fedsa_reference(p, s, statics):
  num_mic, num_mac, ddof = statics
  return ref.fedsa_ref(p, s["n"], cv_threshold=s["cv"], num_mic=num_mic,
                       num_mac=num_mac, sim_threshold=s["sim"], ddof=ddof)


def _fedsa_decided(p, s, valid, statics):
  keep = np.flatnonzero(valid)
  return all(ref.fedsa_cv_margin(x[keep], s["cv"], statics[2]) > 1e-4
             for x in jax.tree.leaves(_f64(p)))


def _signed_updates(draw, m, params):
  """`received = params - d_i` with `d_i = sign_i a_i v`: every pair of updates
  is parallel or opposed (cosine +-1), so with a low temperature a client's
  peers can all lie far below its own similarity (issue item 2)."""
  signs = np.array(draw(st.lists(st.sampled_from([1.0, -1.0]), min_size=m,
                                 max_size=m), label="update signs"))
  sizes = np.array(draw(st.lists(st.sampled_from([0.5, 0.25, 0.125]), min_size=m,
                                 max_size=m), label="update sizes"))

  def one(x):
    x64 = x.astype(np.float64)
    v = draw(hnp.arrays(np.float64, x.shape[1:], elements=st.floats(-1, 1)))
    d = (signs * sizes).reshape((-1,) + (1,) * v.ndim) * v
    mag = float(np.max(np.abs(x64), initial=0.0)) or 1.0
    top = float(jnp.finfo(x.dtype).max)            # received stays finite
    return np.clip(x64 - d * mag, -top, top).astype(x.dtype)
  return jax.tree.map(one, params)


def _draw_feddwa(draw, m, params, valid, dtype):
  if draw(st.booleans(), label="signed updates"):
    received = _signed_updates(draw, m, params)
  else:
    received = sts.like(draw, params)
    same = np.array(draw(st.lists(st.booleans(), min_size=m, max_size=m),
                         label="zero update"), bool)
    received = jax.tree.map(
        lambda r, p: np.where(same.reshape((-1,) + (1,) * (p.ndim - 1)), p, r),
        received, params)
  return {"received": received,
          "alpha": draw(st.sampled_from([0.2, 0.0, 0.5, 1.0]), label="alpha"),
          "temperature": draw(st.sampled_from([1.0, 0.1, 0.01, 0.001]),
                              label="temperature")}


def _feddwa_decided(p, s, valid, statics):
  """Update norms' products are 0 or clearly above the cosine's eps (1e-12)."""
  keep = np.flatnonzero(valid)
  d = ref.flat_clients(_rows(_f64(p), keep)) - ref.flat_clients(
      _rows(_f64(s["received"]), keep))
  norms = np.linalg.norm(d, axis=1)
  products = np.outer(norms, norms)
  return bool(np.all((products == 0) | (products > 1e-11)))


def _fedrema_axes(stats):
  return {"n": (0,), "soft": (0,), "delta": (),
          "state": agg.FedReMaState((0, 1), (), ())}


def _draw_fedrema(draw, m, params, valid, dtype):
  if draw(st.booleans(), label="initial state"):
    state = agg.FedReMaState(np.zeros((m, m), np.int32), np.float32(0.0),
                             np.bool_(True))
  else:
    rows = st.lists(st.integers(0, 4), min_size=m, max_size=m)
    dep = np.array(draw(st.lists(rows, min_size=m, max_size=m)), np.int32)
    dep += np.eye(m, dtype=np.int32)             # reachable: a client selects itself
    state = agg.FedReMaState(
        dep, np.float32(draw(st.sampled_from([0.05, 0.3, 1.0]), label="max_gap")),
        np.bool_(draw(st.booleans(), label="in_ccp")))
  return {"n": sts.counts(draw, m, valid), "soft": sts.soft(draw, m), "state": state,
          "delta": draw(st.sampled_from([0.5, 0.3, 0.9]), label="delta")}


def _fedrema_reference(p, s, valid, statics):
  st_ = s["state"]
  return ref.fedrema_masked_ref(p, s["n"], s["soft"], st_.dependency, st_.max_gap,
                                bool(st_.in_ccp), s["delta"], valid)[0]


def _fedrema_decided(p, s, valid, statics):
  st_ = s["state"]
  return ref.fedrema_margin(s["soft"], valid, float(st_.max_gap), bool(st_.in_ccp),
                            s["delta"]) > 1e-5


def _is_classifier_path(path) -> bool:
  return any(getattr(k, "key", None) == "classifier" for k in path)


AGGS = [
    Agg("fedavg",
        make=lambda _: lambda p, s, mask: agg.fedavg(p, s["n"], mask=mask),
        draw_stats=_draw_n, reference=lambda p, s, _: ref.fedavg_ref(p, s["n"]),
        output="global", axes=_n_axes, counts=("n",)),
    Agg("fedclassavg",
        make=lambda _: lambda p, s, mask: agg.fedclassavg(p, s["n"], mask=mask),
        draw_stats=_draw_n, reference=lambda p, s, _: ref.fedclassavg_ref(p, s["n"]),
        output="personal", axes=_n_axes, counts=("n",)),
    Agg("cw_fedavg_counts",
        make=lambda _: lambda p, s, mask: agg.cw_fedavg(p, s["counts"], mask=mask),
        draw_stats=_draw_counts,
        reference=lambda p, s, _: ref.cw_fedavg_ref(p, s["counts"]),
        output="personal", axes=_n_axes, counts=("counts",), terms=_cw_terms),
    Agg("cw_fedavg_dist_where",
        make=lambda _: lambda p, s, mask: agg.cw_fedavg(
            p, s["dist"], s["n"], where=ptree.under("classifier"), mask=mask),
        draw_stats=_draw_dist,
        reference=lambda p, s, _: ref.cw_fedavg_ref(
            p, s["dist"], s["n"], selected=ref.classifier_flags(p)),
        output="personal", axes=_n_axes, counts=("n", "dist"), terms=_cw_terms),
    Agg("class_models",
        make=lambda _: lambda p, s, mask: agg.class_models(p, s["counts"], mask=mask),
        draw_stats=_draw_counts,
        reference=lambda p, s, _: ref.class_models_ref(p, s["counts"]),
        output="classes", axes=_n_axes, counts=("counts",), terms=_cw_terms),
    Agg("fedsa", make=_fedsa_make, draw_stats=_draw_fedsa, reference=_fedsa_reference,
        output="global", axes=lambda s: {"n": (0,), "cv": (), "sim": ()},
        counts=("n",), statics=FEDSA_STATICS, layouts=("nested",), dyadic=True,
        decided=_fedsa_decided),
    Agg("feddwa",
        make=lambda _: lambda p, s, mask: agg.feddwa(
            p, s["received"], alpha=s["alpha"], temperature=s["temperature"],
            mask=mask),
        draw_stats=_draw_feddwa,
        reference=lambda p, s, _: ref.feddwa_ref(
            p, s["received"], s["alpha"], s["temperature"]),
        output="personal",
        axes=lambda s: {"received": (0,), "alpha": (), "temperature": ()},
        spoiled=("received",), decided=_feddwa_decided,
        terms=lambda m, s, size: m + 8 + 4 * size / s["temperature"]),
    Agg("fedrema",
        make=lambda _: lambda p, s, mask: agg.fedrema(
            p, s["n"], s["soft"], s["state"], delta=s["delta"], mask=mask),
        draw_stats=_draw_fedrema, reference=_fedrema_reference, output="personal",
        axes=_fedrema_axes, counts=("n",), spoiled=("soft",), full_reference=True,
        masked_kept=_is_classifier_path, decided=_fedrema_decided,
        pick=lambda out: out[0]),
]
AGG_BY_NAME = {a.name: a for a in AGGS}
ALL = [a.name for a in AGGS]
WITH_COUNTS = [a.name for a in AGGS if a.counts]


@functools.lru_cache(maxsize=None)
def _jitted(name: str, statics: Any) -> Callable:
  """One compiled function per aggregator and static hyperparameters."""
  return jax.jit(AGG_BY_NAME[name].make(statics))


def _call(a: Agg, case, params=None, stats=None, valid=None):
  """The jitted aggregator's parameter output (FedReMa: without the state)."""
  return a.pick(_jitted(a.name, case.statics)(
      case.params if params is None else params,
      case.stats if stats is None else stats,
      case.valid if valid is None else valid))


@dataclasses.dataclass
class Case:
  m: int
  statics: Any
  params: dict
  valid: np.ndarray
  stats: dict


def _shape(data, a: Agg, low: int = 1) -> tuple[int, str]:
  """`(M, layout)`: any in a wide profile, else one of `sts.FEW_SHAPES`."""
  if sts.WIDE:
    return (data.draw(sts.num_clients(low), label="M"),
            data.draw(st.sampled_from(a.layouts), label="layout"))
  options = [(m, lay) for m, lay in sts.FEW_SHAPES if m >= low and lay in a.layouts]
  options = options or [(m, a.layouts[0]) for m in sts.FEW_CLIENTS if m >= low]
  return data.draw(st.sampled_from(options), label="(M, layout)")


def _one_shape(data, a: Agg) -> tuple[int, str]:
  """`(M, layout)` for the dtype and eager tests: any in a wide profile, else
  (3, "nested"), one shape per dtype and aggregator to compile."""
  return _shape(data, a) if sts.WIDE else (3, "nested")


def _draw_case(data, a: Agg, dtype="float32", *, shape=None, ties=None,
               extreme=True, valid=None, spoil=True) -> Case:
  """Params, mask and statistics for `a`; masked clients' rows spoiled."""
  draw = data.draw
  m, layout = _shape(data, a) if shape is None else shape
  statics = draw(st.sampled_from(a.statics if sts.WIDE else a.statics[:1]),
                 label="statics")
  params = sts.stacked(draw, m, sts.LAYOUTS[layout], dtype, extreme=extreme,
                       dyadic=a.dyadic, rows=ties)
  valid = sts.mask(draw, m) if valid is None else valid
  stats = a.draw_stats(draw, m, params, valid, dtype)
  if spoil and not valid.all():
    params = sts.spoil(draw, params, valid)
    stats = dict(stats, **{k: sts.spoil(draw, stats[k], valid) for k in a.spoiled})
  if a.decided is not None:
    assume(a.decided(params, stats, valid, statics))
  return Case(m, statics, params, valid, stats)


def _expected(a: Agg, case: Case):
  """The reference result in float64, masked rows as the contract says."""
  params = _f64(case.params)
  if a.full_reference:
    return a.reference(params, case.stats, case.valid, case.statics)
  keep = np.flatnonzero(case.valid)
  sub = a.reference(_rows(params, keep), _take(case.stats, a.axes(case.stats), keep),
                    case.statics)
  return _embed(sub, params, keep) if a.output == "personal" else sub


def _atols(a: Agg, case: Case, dtype) -> list[float]:
  terms = a.terms(case.m, case.stats, _size(case.params))
  return [_tolerance(dtype, s, terms) for s in _scales(case.params, case.valid)]


def _valid_part(a: Agg, out, valid):
  return _rows(out, np.flatnonzero(valid)) if a.output == "personal" else out


def _check_reference(a: Agg, case: Case, out, dtype):
  _assert_dtypes(out, case.params)
  for leaf in jax.tree.leaves(_valid_part(a, out, case.valid)):
    assert np.all(np.isfinite(np.asarray(leaf, np.float64))), "non-finite output"
  _assert_close(out, _expected(a, case), _atols(a, case, dtype), a.name)


# ------------------------------------------------------ generic properties


@pytest.mark.parametrize("name", ALL)
@budget()
@given(data=st.data())
def test_matches_reference(name, data):
  """float32, every magnitude, ties, masked clients uploading NaN/inf: the
  output has the input dtypes, is finite and agrees with the reference."""
  a = AGG_BY_NAME[name]
  case = _draw_case(data, a)
  _check_reference(a, case, _call(a, case), jnp.float32)


@pytest.mark.parametrize("name", ALL)
@budget()
@given(data=st.data())
def test_masked_clients_ignored_and_unchanged(name, data):
  """What masked clients upload never changes the others' results, and
  personalized aggregators return masked clients' (classifier) rows as given."""
  a = AGG_BY_NAME[name]
  m, layout = _shape(data, a, low=2)
  valid = np.array(data.draw(st.lists(st.booleans(), min_size=m, max_size=m),
                             label="valid"), bool)
  bad = data.draw(st.integers(0, m - 1), label="a masked client")
  valid[bad] = False
  valid[(bad + 1 + data.draw(st.integers(0, m - 2), label="a valid client")) % m] = True
  case = _draw_case(data, a, shape=(m, layout), valid=valid, spoil=False)
  clean = _call(a, case)
  spoiled_params = sts.spoil(data.draw, case.params, valid)
  spoiled_stats = dict(case.stats, **{k: sts.spoil(data.draw, case.stats[k], valid)
                                      for k in a.spoiled})
  out = _call(a, case, spoiled_params, spoiled_stats)
  for x, y in zip(jax.tree.leaves(_valid_part(a, out, valid)),
                  jax.tree.leaves(_valid_part(a, clean, valid))):
    np.testing.assert_array_equal(x, y)
  if a.output == "personal":
    for (path, x), p in zip(jax.tree_util.tree_leaves_with_path(out),
                            jax.tree.leaves(spoiled_params)):
      if a.masked_kept(path):
        np.testing.assert_array_equal(np.asarray(x)[~valid], p[~valid],
                                      err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("name", ALL)
@budget()
@given(data=st.data())
def test_client_permutation(name, data):
  """Permuting clients permutes personalized outputs and leaves global and
  class outputs unchanged (FedSA: where the reference's own tie rule, lowest
  index first, does not make the answer order-dependent)."""
  a = AGG_BY_NAME[name]
  case = _draw_case(data, a)
  perm = sts.permutation(data.draw, case.m)
  axes = a.axes(case.stats)
  moved = Case(case.m, case.statics, _rows(case.params, perm),
               case.valid[perm], _take(case.stats, axes, perm))
  if a.name == "fedsa":
    atols = _atols(a, case, jnp.float32)
    same = all(np.allclose(x, y, rtol=0, atol=t) for x, y, t in zip(
        jax.tree.leaves(_expected(a, case)), jax.tree.leaves(_expected(a, moved)),
        atols))
    if not same:
      hypothesis.event("order-dependent FedSA tie")
      return
  out, out_moved = _call(a, case), _call(a, moved)
  if a.output == "personal":
    out = _rows(out, perm)
  _assert_close(out_moved, _f64(out), [2 * t for t in _atols(a, case, jnp.float32)],
                a.name)


@pytest.mark.parametrize("name", ALL)
@budget()
@given(data=st.data())
def test_identical_clients_are_a_fixed_point(name, data):
  """If every valid client holds the same model x, every output is x."""
  a = AGG_BY_NAME[name]
  m, layout = _shape(data, a)
  case = _draw_case(data, a, shape=(m, layout), ties=(1, [0] * m))
  out = _valid_part(a, _call(a, case), case.valid)
  x = _rows(case.params, np.flatnonzero(case.valid)[0])
  for got, want, t in zip(jax.tree.leaves(out), jax.tree.leaves(_f64(x)),
                          _atols(a, case, jnp.float32)):
    np.testing.assert_allclose(np.asarray(got, np.float64),
                               np.broadcast_to(want, np.shape(got)), rtol=0, atol=t)


COUNT_SCALES = {"2**-40": 2.0**-40, "3": 3.0, "2**100": 2.0**100,
                "near float32 max": None}


@pytest.mark.parametrize("name", WITH_COUNTS)
@budget()
@given(data=st.data())
def test_count_scale_invariance(name, data):
  """Multiplying sample or class counts by c > 0 changes nothing, up to counts
  near float32's maximum."""
  a = AGG_BY_NAME[name]
  case = _draw_case(data, a)
  how = data.draw(st.sampled_from(sorted(COUNT_SCALES)), label="scale")
  scaled = dict(case.stats)
  for key in a.counts:
    x = np.asarray(case.stats[key], np.float64)
    if x.max() > 0:
      c = COUNT_SCALES[how] or 0.99 * float(np.finfo(np.float32).max) / x.max()
      scaled[key] = (x * c).astype(np.float32)
  out, out_scaled = _call(a, case), _call(a, case, stats=scaled)
  _assert_close(_valid_part(a, out_scaled, case.valid),
                _f64(_valid_part(a, out, case.valid)),
                [2 * t for t in _atols(a, case, jnp.float32)], a.name)


@pytest.mark.parametrize("name", ALL)
@budget()
@given(data=st.data())
def test_low_precision_dtype(name, data):
  """float16 / bfloat16 in, the same dtype out; statistics in float32, so the
  result is the reference up to the output's rounding."""
  a = AGG_BY_NAME[name]
  dtype = data.draw(st.sampled_from(["float16", "bfloat16"]), label="dtype")
  case = _draw_case(data, a, dtype, shape=_one_shape(data, a))
  _check_reference(a, case, _call(a, case), jnp.dtype(dtype))


@pytest.mark.parametrize("name", ALL)
@budget(0.5)
@given(data=st.data())
def test_float64_under_x64(name, data):
  """float64 in (jax.enable_x64): float64 out, statistics and weights in
  float64, so the reference holds to ~1e-14 relative (docs/methods.md common rules, issue 11 item 5)."""
  a = AGG_BY_NAME[name]
  case = _draw_case(data, a, "float64", shape=_one_shape(data, a))
  with jax.enable_x64(True):
    out = _call(a, case)
    _check_reference(a, case, out, jnp.float64)


@pytest.mark.parametrize("name", ALL)
@budget(0.4)
@given(data=st.data())
def test_jit_matches_eager(name, data):
  a = AGG_BY_NAME[name]
  case = _draw_case(data, a, shape=_one_shape(data, a))
  eager = a.pick(a.make(case.statics)(case.params, case.stats, case.valid))
  _assert_close(eager, _f64(_call(a, case)), _atols(a, case, jnp.float32), a.name)


ZERO_WEIGHT = ["fedavg", "fedclassavg", "cw_fedavg_counts", "cw_fedavg_dist_where",
               "class_models", "fedsa", "fedrema"]


@pytest.mark.parametrize("name", ZERO_WEIGHT)
@budget(0.4)
@given(data=st.data())
def test_zero_total_weight(name, data):
  """Issue item 4: no positive weight among valid clients (all-False mask or
  zero counts). Eagerly a ValueError naming the argument; under jit a finite
  documented result: personalized -> params unchanged, global -> zeros."""
  a = AGG_BY_NAME[name]
  case = _draw_case(data, a, shape=_one_shape(data, a), spoil=False)
  how = data.draw(st.sampled_from(["mask", "counts"]), label="zero by")
  stats, valid = dict(case.stats), case.valid
  if how == "mask":
    valid = np.zeros(case.m, bool)
  else:
    for key in a.counts:
      stats[key] = np.zeros_like(stats[key])
  listed = name not in ("fedclassavg", "fedrema")     # named in issue item 4
  fn = a.make(case.statics)
  try:
    eager = a.pick(fn(case.params, stats, valid))
  except ValueError as e:
    names = ("mask",) if how == "mask" else ("num_samples", "class_dist")
    assert any(n in str(e) for n in names), str(e)
  else:
    assert not listed, f"{name}: zero total weight accepted without an error"
    for leaf in jax.tree.leaves(eager):
      assert np.all(np.isfinite(np.asarray(leaf, np.float64)))
  out = _call(a, case, stats=stats, valid=valid)
  for got, p in zip(jax.tree.leaves(out), jax.tree.leaves(case.params)):
    got = np.asarray(got, np.float64)
    assert np.all(np.isfinite(got)), f"{name}: non-finite result under jit"
    flush = 4 * float(jnp.finfo(jnp.float32).tiny)   # XLA-CPU flushes subnormals
    if a.output == "personal":
      np.testing.assert_allclose(got, p, rtol=0, atol=flush)
    elif a.output == "global":
      np.testing.assert_allclose(got, 0.0, rtol=0, atol=flush)


# ------------------------------------------------- method-specific properties


@functools.lru_cache(maxsize=None)
def _cw_distribution():
  return jax.jit(lambda p, dist, n, mask: agg.cw_fedavg(p, dist, n, mask=mask))


@budget()
@given(data=st.data())
def test_cw_fedavg_iid_equals_fedavg(data):
  """cwFedAvg Sec. 4.3: identical class distributions reduce it to FedAvg
  (counts mode: weights n_i; distribution mode: weights num_samples)."""
  m = data.draw(sts.num_clients(), label="M")
  k = data.draw(sts.num_classes(), label="K")
  params = sts.stacked(data.draw, m, sts.LAYOUTS["nested"])
  valid = sts.mask(data.draw, m)
  share = np.array(data.draw(st.lists(st.integers(0, 5), min_size=k, max_size=k),
                             label="class shares"), np.float64)
  share[data.draw(st.integers(0, k - 1))] += 1
  scale = np.array(data.draw(st.lists(st.integers(1, 9), min_size=m, max_size=m),
                             label="client sizes"), np.float64)
  counts = (scale[:, None] * share[None, :]).astype(np.float32)
  keep = np.flatnonzero(valid)
  atols = [_tolerance(jnp.float32, s, 2 * (m + k) + 8) for s in _scales(params, valid)]
  expected = ref.fedavg_ref(_rows(params, keep), counts[keep].sum(axis=1))
  dist = np.broadcast_to(share, (m, k)).astype(np.float32)
  for mode_out in (_jitted("cw_fedavg_counts", None)(params, {"counts": counts}, valid),
                   _cw_distribution()(params, dist, scale.astype(np.float32), valid)):
    rows = _rows(mode_out, keep)
    want = jax.tree.map(lambda e: np.broadcast_to(e, (len(keep),) + e.shape), expected)
    _assert_close(rows, want, atols, "cw_fedavg iid")


@budget()
@given(data=st.data())
def test_cw_fedavg_one_class_per_client(data):
  """cwFedAvg Sec. 4.3: with one class per client, client i gets the FedAvg of
  the clients holding its class; a class held by one client keeps its model."""
  m = data.draw(sts.num_clients(), label="M")
  k = data.draw(sts.num_classes(), label="K")
  params = sts.stacked(data.draw, m, sts.LAYOUTS["flat"])
  valid = sts.mask(data.draw, m)
  label = np.array(data.draw(st.lists(st.integers(0, k - 1), min_size=m, max_size=m),
                             label="class of client"))
  n = np.array(data.draw(st.lists(st.integers(1, 20), min_size=m, max_size=m),
                         label="sizes"), np.float64)
  counts = np.zeros((m, k), np.float32)
  counts[np.arange(m), label] = n
  out = _jitted("cw_fedavg_counts", None)(params, {"counts": counts}, valid)
  p64 = _f64(params)
  atols = [_tolerance(jnp.float32, s, 2 * (m + k) + 8) for s in _scales(params, valid)]
  for i in np.flatnonzero(valid):
    peers = np.flatnonzero(valid & (label == label[i]))
    want = ref.fedavg_ref(_rows(p64, peers), n[peers])
    _assert_close(_rows(out, i), want, atols, f"client {i}")


@budget(2)
@given(data=st.data())
def test_feddwa_weights_rows(data):
  """With an identity leaf the output is FedDWA's weight matrix itself: rows
  sum to 1, the diagonal is alpha (1 without peers), peers' weights are
  non-negative and equal the reference (Eq. 3-6), at any temperature."""
  m = data.draw(sts.num_clients(), label="M")
  other = sts.stacked(data.draw, m, {"v": (3,)}, extreme=False)
  params = {"eye": np.eye(m, dtype=np.float32), **other}
  valid = sts.mask(data.draw, m)
  stats = _draw_feddwa(data.draw, m, params, valid, "float32")
  assume(_feddwa_decided(params, stats, valid, None))
  out = np.asarray(_jitted("feddwa", None)(params, stats, valid)["eye"], np.float64)
  keep = np.flatnonzero(valid)
  beta = out[np.ix_(keep, keep)]
  alpha = stats["alpha"] if len(keep) > 1 else 1.0
  tol = 1e-5 + 5e-5 / stats["temperature"]
  np.testing.assert_allclose(beta.sum(axis=1), 1.0, rtol=0, atol=1e-5)
  np.testing.assert_allclose(np.diag(beta), alpha, rtol=0, atol=1e-6)
  assert np.all(beta >= 0)
  expected = ref.feddwa_weights_ref(
      _rows(params, keep), _rows(stats["received"], keep), stats["alpha"],
      stats["temperature"])
  np.testing.assert_allclose(beta, expected, rtol=0, atol=tol)


@budget()
@given(data=st.data())
def test_fedrema_round_selects_self_and_matches_reference(data):
  """A CCP or history round: with an identity classifier the output rows are
  the mixing weights. Every valid client selects itself (positive self weight,
  `dependency[k, k] += 1` in the CCP, issue item 1); params and the new state
  agree with the reference; the state keeps its dtypes."""
  m = data.draw(sts.num_clients(), label="M")
  params = {"features": {"w": sts.stacked(data.draw, m, {"w": (2,)},
                                          extreme=False)["w"]},
            "classifier": {"eye": np.eye(m, dtype=np.float32)}}
  valid = sts.mask(data.draw, m)
  stats = _draw_fedrema(data.draw, m, params, valid, "float32")
  stats["soft"] = sts.spoil(data.draw, stats["soft"], valid)
  assume(_fedrema_decided(params, stats, valid, None))
  s = stats["state"]
  out, new = _jitted("fedrema", None)(params, stats, valid)
  exp, dep, max_gap, in_ccp = ref.fedrema_masked_ref(
      _f64(params), stats["n"], stats["soft"], s.dependency, s.max_gap, bool(s.in_ccp),
      stats["delta"], valid)
  keep = np.flatnonzero(valid)
  mixing = np.asarray(out["classifier"]["eye"], np.float64)
  holds_data = keep[stats["n"][keep] > 0]    # a client with n_k = 0 has weight 0
  assert np.all(np.diag(mixing)[holds_data] > 0), "a client dropped itself"
  if s.in_ccp:
    np.testing.assert_array_equal(np.diag(np.asarray(new.dependency))[keep],
                                  np.diag(s.dependency)[keep] + 1)
  _assert_close(out, exp, [1e-5 * max(1.0, sc) for sc in _scales(params, valid)])
  np.testing.assert_array_equal(new.dependency, dep)
  np.testing.assert_allclose(float(new.max_gap), max_gap, rtol=1e-5, atol=1e-6)
  assert bool(new.in_ccp) == in_ccp
  assert (new.dependency.dtype, new.max_gap.dtype, new.in_ccp.dtype) == (
      jnp.int32, jnp.float32, jnp.bool_)


@budget()
@given(data=st.data())
def test_fedrema_state_permutation(data):
  """Permuting clients permutes the new state's dependency on both axes."""
  a = AGG_BY_NAME["fedrema"]
  case = _draw_case(data, a)
  perm = sts.permutation(data.draw, case.m)
  s = case.stats
  moved = _take(s, a.axes(s), perm)
  _, new = _jitted("fedrema", None)(case.params, s, case.valid)
  _, new_moved = _jitted("fedrema", None)(_rows(case.params, perm), moved,
                                          case.valid[perm])
  np.testing.assert_array_equal(new_moved.dependency,
                                np.asarray(new.dependency)[np.ix_(perm, perm)])
  np.testing.assert_allclose(float(new_moved.max_gap), float(new.max_gap), rtol=1e-6)
  assert bool(new_moved.in_ccp) == bool(new.in_ccp)


@budget()
@given(data=st.data())
def test_relevance_and_mds(data):
  """relevance: symmetric, diagonal exactly 1, cosines within [0, 1] (never
  rounded above 1), close to the reference. mds on each row: the client itself
  and at least one peer are selected, as the value-tie reference says."""
  m = data.draw(sts.num_clients(), label="M")
  soft = sts.soft(data.draw, m, data.draw(st.sampled_from([3, 5]), label="C"))
  assume(ref.fedrema_margin(soft, np.ones(m, bool), 0.0, True) > 1e-5)
  s = np.asarray(jax.jit(agg.relevance)(soft))
  np.testing.assert_array_equal(np.diag(s), 1.0)
  np.testing.assert_array_equal(s, s.T)
  assert np.all(s <= 1.0) and np.all(s >= 0.0), s
  expected = ref.relevance_exact_ref(soft)
  np.testing.assert_allclose(s, expected, rtol=0, atol=1e-6)
  selected, gaps = jax.jit(jax.vmap(agg.mds))(s)
  for k in range(m):
    want, gap = ref.mds_value_ref(expected[k])
    assert selected[k, k], f"client {k} did not select itself: {s[k]}"
    assert m == 1 or selected[k].sum() >= 2
    np.testing.assert_array_equal(selected[k], want, err_msg=f"row {k}: {s[k]}")
    np.testing.assert_allclose(gaps[k], gap, rtol=0, atol=1e-6)


@budget()
@given(data=st.data())
def test_soft_logits(data):
  m = data.draw(sts.num_clients(), label="M")
  mag = data.draw(st.sampled_from([1.0, 1e-6, 1e3, 1e30]), label="magnitude")
  logits = data.draw(hnp.arrays(np.float64, (m, 3), elements=st.floats(-1, 1))) * mag
  logits = logits.astype(np.float32)
  t = data.draw(st.sampled_from([0.5, 1.0, 0.05]), label="temperature")
  out = np.asarray(jax.jit(agg.soft_logits)(logits, t), np.float64)
  assert np.all(np.isfinite(out)) and np.all(out >= 0)
  np.testing.assert_allclose(out.sum(axis=1), 1.0, atol=1e-6)
  np.testing.assert_allclose(out, ref.soft_logits_ref(logits, t), rtol=1e-5, atol=1e-6)


@budget()
@given(data=st.data())
def test_estimate_class_dist(data):
  """Eq. 4 on (F, K) or stacked (M, F, K) kernels at every magnitude: finite,
  non-negative rows summing to 1, the reference, columns permute with classes."""
  lead = data.draw(st.sampled_from([(), (3,)]), label="stacked")
  f = data.draw(st.integers(1, 3), label="F")
  k = data.draw(sts.num_classes(), label="K")
  dtype = data.draw(st.sampled_from(["float32", "bfloat16", "float16"]), label="dtype")
  mags = sts.MAGNITUDES[dtype] + sts.EXTREME_MAGNITUDES[dtype]
  mag = data.draw(st.sampled_from(mags), label="magnitude")
  kernel = (data.draw(hnp.arrays(np.float64, lead + (f, k), elements=st.floats(-1, 1)))
            * mag).astype(sts.DTYPES[dtype])
  out = np.asarray(jax.jit(agg.estimate_class_dist)(kernel), np.float64)
  assert out.shape == lead + (k,)
  assert np.all(np.isfinite(out)) and np.all(out >= 0), out
  np.testing.assert_allclose(out.sum(axis=-1), 1.0, atol=1e-5)
  np.testing.assert_allclose(out, ref.estimate_class_dist_ref(kernel), rtol=0,
                             atol=1e-5)
  perm = sts.permutation(data.draw, k)
  moved = np.asarray(jax.jit(agg.estimate_class_dist)(kernel[..., perm]))
  np.testing.assert_allclose(moved, out[..., perm], rtol=0, atol=1e-6)


@budget()
@given(data=st.data())
def test_personalize(data):
  """Eq. 7 from stored class models: the reference (rows normalised, zero rows
  uniform), dtypes kept; permuting clients permutes rows, permuting classes
  jointly (models and columns) changes nothing."""
  k = data.draw(sts.num_classes(), label="K")
  m = data.draw(sts.num_clients(), label="M")
  dtype = data.draw(st.sampled_from(["float32", "bfloat16", "float16"]), label="dtype")
  models = sts.stacked(data.draw, k, sts.LAYOUTS["nested"], dtype)
  counts = data.draw(hnp.arrays(np.float64, (m, k),
                                elements=st.integers(0, 9).map(float)))
  scale = data.draw(st.sampled_from([1.0, 0.1, 1e30]), label="count scale")
  dist = (counts * scale).astype(np.float32)
  fn = jax.jit(agg.personalize)
  out = fn(models, dist)
  _assert_dtypes(out, models)
  atols = [_tolerance(jnp.dtype(dtype), s, k + 8)
           for s in _scales(models, np.ones(k, bool))]
  _assert_close(out, ref.personalize_ref(_f64(models), dist), atols, "personalize")
  perm_m, perm_k = sts.permutation(data.draw, m), sts.permutation(data.draw, k)
  _assert_close(fn(models, dist[perm_m]), _rows(_f64(out), perm_m), atols, "clients")
  _assert_close(fn(_rows(models, perm_k), dist[:, perm_k]), _f64(out), atols, "classes")


# ------------------------------------------------------------- pflax.tree


@budget()
@given(data=st.data())
def test_tree_mix(data):
  m = data.draw(sts.num_clients(), label="M")
  o = data.draw(st.sampled_from([1, m]), label="O")
  dtype = data.draw(st.sampled_from(["float32", "bfloat16", "float16"]), label="dtype")
  stacked = sts.stacked(data.draw, m, sts.LAYOUTS["nested"], dtype)
  weights = data.draw(hnp.arrays(np.float64, (o, m), elements=st.floats(-1, 1)))
  weights = (weights / np.maximum(1.0, np.abs(weights).sum(axis=1, keepdims=True))
             ).astype(np.float32)                # |out| <= max |x|: no overflow
  out = jax.jit(ptree.mix)(weights, stacked)
  _assert_dtypes(out, stacked)
  atols = [_tolerance(jnp.dtype(dtype), s, m + 8)
           for s in _scales(stacked, np.ones(m, bool))]
  _assert_close(out, ref.mix_ref(weights, stacked), atols, "mix")
  perm = sts.permutation(data.draw, m)
  _assert_close(jax.jit(ptree.mix)(weights[:, perm], _rows(stacked, perm)), _f64(out),
                [2 * t for t in atols], "mix permuted")


@budget()
@given(data=st.data())
def test_tree_weighted_mean(data):
  """Reference, permutation invariance, weight-scale invariance (up to
  float32's maximum)."""
  m = data.draw(sts.num_clients(), label="M")
  dtype = data.draw(st.sampled_from(["float32", "bfloat16", "float16"]), label="dtype")
  stacked = sts.stacked(data.draw, m, sts.LAYOUTS["flat"], dtype)
  w = sts.counts(data.draw, m, np.ones(m, bool))
  fn = jax.jit(ptree.weighted_mean)
  out = fn(stacked, w)
  _assert_dtypes(out, stacked)
  atols = [_tolerance(jnp.dtype(dtype), s, m + 8)
           for s in _scales(stacked, np.ones(m, bool))]
  for leaf in jax.tree.leaves(out):
    assert np.all(np.isfinite(np.asarray(leaf, np.float64)))
  _assert_close(out, ref.fedavg_ref(stacked, w), atols, "weighted_mean")
  perm = sts.permutation(data.draw, m)
  _assert_close(fn(_rows(stacked, perm), w[perm]), _f64(out), atols, "permuted")
  big = (w.astype(np.float64) * (0.99 * float(np.finfo(np.float32).max) / w.max()))
  _assert_close(fn(stacked, big.astype(np.float32)), _f64(out), atols, "scaled")


@budget()
@given(data=st.data())
def test_tree_cosine_similarity(data):
  """Reference (zero vectors: cosine 0), symmetric, within [-1, 1], and the
  same for the parameters scaled by 2**60 (no overflow of the Gram matrix)."""
  m = data.draw(sts.num_clients(), label="M")
  stacked = sts.stacked(data.draw, m, sts.LAYOUTS["nested"])
  flat = ref.flat_clients(stacked)
  norms = np.linalg.norm(flat, axis=1)
  products = np.outer(norms, norms)
  assume(np.all((products == 0) | (products > 1e-11)))
  fn = jax.jit(ptree.cosine_similarity)
  s = np.asarray(fn(stacked), np.float64)
  np.testing.assert_allclose(s, ref.cosine_matrix(flat), rtol=0, atol=1e-5)
  np.testing.assert_array_equal(s, s.T)
  assert np.all(np.abs(s) <= 1 + 1e-6)
  scaled = jax.tree.map(lambda x: (x.astype(np.float64) * 2.0**60).astype(x.dtype),
                        stacked)
  assume(all(np.all(np.isfinite(x)) for x in jax.tree.leaves(scaled)))
  np.testing.assert_allclose(np.asarray(fn(scaled), np.float64), s, rtol=0, atol=1e-5)


@budget()
@given(data=st.data())
def test_tree_finite_clients(data):
  m = data.draw(sts.num_clients(), label="M")
  stacked = sts.stacked(data.draw, m, sts.LAYOUTS["nested"])
  flat = [x.reshape(m, -1) for x in jax.tree.leaves(stacked)]
  for _ in range(data.draw(st.integers(0, 4), label="bad entries")):
    leaf = flat[data.draw(st.integers(0, len(flat) - 1))]
    leaf[data.draw(st.integers(0, m - 1)),
         data.draw(st.integers(0, leaf.shape[1] - 1))] = data.draw(
             st.sampled_from([np.nan, np.inf, -np.inf]))
  out = np.asarray(jax.jit(ptree.finite_clients)(stacked))
  np.testing.assert_array_equal(out, ref.finite_clients_ref(stacked))
  perm = sts.permutation(data.draw, m)
  np.testing.assert_array_equal(jax.jit(ptree.finite_clients)(_rows(stacked, perm)),
                                out[perm])
