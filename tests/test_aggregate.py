"""FedAvg, cwFedAvg, FedClassAvg and FedDWA against loop references (references.py)
and the special cases stated in the papers."""

import functools

import jax
from jax import test_util as jtu
import jax.numpy as jnp
import numpy as np
import pytest

from pflax import aggregate as agg
from pflax import tree as ptree

import references as ref

TRANSFORMS = [pytest.param(ref.no_jit, id="nojit"), pytest.param(jax.jit, id="jit")]
assert_tree_close = ref.assert_tree_close
# (M, K): one client, two clients, K > M (dense mixing) and K < M (factored).
SIZES = ref.sweep([(1, 3), (2, 5), (6, 2)], [(4, 7)])
CLIENTS = ref.sweep([1, 2, 6], [4])


def _counts(rng, m, k, zero_class=True):
  """Random class counts with empty entries and (if K > 1) one absent class."""
  counts = rng.integers(0, 6, size=(m, k)) * (rng.uniform(size=(m, k)) < 0.7)
  if zero_class and k > 1:
    counts[:, k - 1] = 0
  counts[:, 0] += 1                          # every client has data
  return counts.astype(np.int32)


# ---------------------------------------------------------------------- FedAvg


@pytest.mark.parametrize("transform,m", CLIENTS)
@pytest.mark.parametrize("weighted", [False, True])
def test_fedavg_matches_reference(transform, m, weighted):
  rng = np.random.default_rng(m)
  params = ref.random_params(rng, m)
  n = rng.integers(0, 50, size=m).astype(np.int32) + 1 if weighted else None
  if weighted and m > 1:
    n[0] = 0                                 # a client without data has no weight
  out = transform(agg.fedavg)(params, n)
  assert_tree_close(out, ref.fedavg_ref(params, n))


@pytest.mark.parametrize("transform,m", CLIENTS)
def test_fedclassavg_matches_reference(transform, m):
  rng = np.random.default_rng(10 + m)
  params = ref.random_params(rng, m)
  n = rng.integers(1, 50, size=m)
  out = transform(agg.fedclassavg)(params, n)
  assert_tree_close(out, ref.fedclassavg_ref(params, n))
  assert_tree_close(transform(agg.fedclassavg)(params), ref.fedclassavg_ref(params))
  # Non-classifier leaves are untouched (exactly).
  for name in ("conv", "dense"):
    np.testing.assert_array_equal(out["features"][name], params["features"][name])


def test_fedclassavg_model_heterogeneous_groups_via_concat():
  rng = np.random.default_rng(0)
  group_a = {"features": {"w": rng.normal(size=(2, 4))},
             "classifier": {"kernel": rng.normal(size=(2, 3, 5))}}
  group_b = {"features": {"v": rng.normal(size=(3, 6, 2))},
             "classifier": {"kernel": rng.normal(size=(3, 3, 5))}}
  heads = ptree.concat([group_a["classifier"], group_b["classifier"]])
  n = np.array([1, 2, 3, 4, 5])
  averaged = agg.fedclassavg(heads, n, where=None)
  expected = ref.fedavg_ref(heads, n)["kernel"]
  for i in range(5):
    np.testing.assert_allclose(averaged["kernel"][i], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transform,m", CLIENTS)
def test_fedclassavg_is_fedavg_of_the_classifier_in_every_client(transform, m):
  """Eq. (3) is `fedavg` of the selected leaves, broadcast back (bit for bit);
  masked clients keep their parameters."""
  rng = np.random.default_rng(20 + m)
  params = ref.random_params(rng, m)
  n = rng.integers(1, 50, size=m)
  mask = np.arange(m) != 1 if m > 1 else None
  where = ptree.under("classifier", "output")
  out = transform(functools.partial(agg.fedclassavg, where=where))(params, n, mask=mask)
  head = agg.fedavg(ptree.selected(params, where), n, mask=mask)
  expected = ptree.with_selected(params, where, ptree.broadcast(head, m))
  if mask is not None:
    expected = jax.tree.map(lambda a, b: np.where(
        mask.reshape((-1,) + (1,) * (a.ndim - 1)), a, b), expected, params)
  jax.tree.map(np.testing.assert_array_equal, out, expected)


# -------------------------------------------------------------------- cwFedAvg


@pytest.mark.parametrize("transform,m,k", SIZES)
def test_cw_fedavg_counts_mode(transform, m, k):
  rng = np.random.default_rng(100 * m + k)
  params = ref.random_params(rng, m)
  counts = _counts(rng, m, k)
  if m > 2:
    counts[2] = 0                    # no data: weight 0, gets the uniform mix of G_j
  out = transform(agg.cw_fedavg)(params, counts)
  assert_tree_close(out, ref.cw_fedavg_ref(params, counts))


@pytest.mark.parametrize("transform,m,k", SIZES)
def test_cw_fedavg_distribution_mode(transform, m, k):
  rng = np.random.default_rng(200 * m + k)
  params = ref.random_params(rng, m)
  dist = rng.uniform(size=(m, k)).astype(np.float32) * 3   # unnormalised rows
  if m > 2:
    dist[1] = 0.0                                           # zero row -> uniform
  n = rng.integers(1, 40, size=m)
  out = transform(agg.cw_fedavg)(params, dist, n)
  assert_tree_close(out, ref.cw_fedavg_ref(params, dist, n))


@pytest.mark.parametrize("transform,m,k", ref.sweep([(1, 3), (6, 2)], [(4, 7)]))
def test_cw_fedavg_where_gives_fedavg_elsewhere(transform, m, k):
  rng = np.random.default_rng(300 * m + k)
  params = ref.random_params(rng, m)
  counts = _counts(rng, m, k)
  flags = ref.classifier_flags(params)
  fn = functools.partial(agg.cw_fedavg, where=ptree.under("classifier"))
  out = transform(fn)(params, counts)
  expected = ref.cw_fedavg_ref(params, counts, selected=flags)
  assert_tree_close(out, expected)
  # The non-selected leaves are the FedAvg with p_i = n_i / sum n, in every client.
  fedavg = ref.fedavg_ref(params, counts.sum(axis=1))
  for i in range(m):
    np.testing.assert_allclose(out["features"]["dense"][i], fedavg["features"]["dense"],
                               rtol=2e-5, atol=2e-5)
  if transform is ref.no_jit:
    # A bool pytree selects the same leaves; with distributions + num_samples too.
    where = ref.unflatten_like(params, flags)
    assert_tree_close(agg.cw_fedavg(params, counts, where=where), expected)
    dist, n = counts / counts.sum(1, keepdims=True), rng.integers(1, 9, size=m)
    assert_tree_close(agg.cw_fedavg(params, dist, n, where=where),
                      ref.cw_fedavg_ref(params, dist, n, selected=flags))


@pytest.mark.parametrize("transform,m,k", ref.sweep([(1, 3), (6, 2)], [(4, 7)]))
def test_class_models_and_personalize(transform, m, k):
  rng = np.random.default_rng(400 * m + k)
  params = ref.random_params(rng, m)
  counts = _counts(rng, m, k)
  models = transform(agg.class_models)(params, counts)
  assert ptree.num_clients(models) == k
  assert_tree_close(models, ref.class_models_ref(params, counts))
  dist, n = rng.uniform(size=(m, k)), rng.integers(1, 9, size=m)
  assert_tree_close(transform(agg.class_models)(params, dist, n),
                    ref.class_models_ref(params, dist, n))
  # personalize is Eq. (7) on stored models, for any clients (here 4 new ones).
  other = rng.uniform(size=(4, k))
  other[0] = 0.0
  assert_tree_close(transform(agg.personalize)(models, other),
                    ref.personalize_ref(models, other))
  # class_models followed by personalize is cw_fedavg.
  assert_tree_close(transform(agg.personalize)(models, counts),
                    transform(agg.cw_fedavg)(params, counts), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transform,m,k", SIZES)
def test_cw_fedavg_is_class_models_then_personalize_and_fedavg_elsewhere(transform, m, k):
  """Eq. (5)-(7) are `class_models` then `personalize` on the selected leaves,
  and `fedavg` (weights `p_i`) in every client on the others; masked clients
  keep their parameters. Up to float32 rounding: `cw_fedavg` mixes once,
  possibly in the other order."""
  rng = np.random.default_rng(500 * m + k)
  params = ref.random_params(rng, m)
  counts = _counts(rng, m, k)
  mask = np.arange(m) != 0 if m > 1 else None
  where = ptree.under("classifier")
  fn = functools.partial(agg.cw_fedavg, where=where, mask=mask)
  out = transform(fn)(params, counts)
  personal = agg.personalize(agg.class_models(params, counts, mask=mask), counts)
  rest = agg.fedavg(params, counts.sum(axis=1), mask=mask)
  expected = ref.unflatten_like(params, [
      p if flag else np.broadcast_to(r, p.shape) for p, r, flag in zip(
          jax.tree.leaves(personal), jax.tree.leaves(rest),
          ref.classifier_flags(params))])
  if mask is not None:
    expected = jax.tree.map(lambda a, b: np.where(
        mask.reshape((-1,) + (1,) * (a.ndim - 1)), a, b), expected, params)
  assert_tree_close(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_estimate_class_dist(transform):
  rng = np.random.default_rng(0)
  kernel = rng.normal(size=(4, 3, 5)).astype(np.float32)
  kernel[1, :, 2] = 0.0                    # a class with a zero weight vector
  kernel[3] = 0.0                          # an all-zero kernel -> uniform 1/K
  out = transform(agg.estimate_class_dist)(kernel)
  assert out.shape == (4, 5) and out.dtype == jnp.float32
  np.testing.assert_allclose(out, ref.estimate_class_dist_ref(kernel), rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(out[3], np.full(5, 0.2), rtol=1e-6)
  assert out[1, 2] == 0.0
  single = transform(agg.estimate_class_dist)(kernel[0])
  np.testing.assert_allclose(single, out[0], rtol=1e-6)
  # Norms are not squared: scaling one column scales its share linearly.
  k = np.ones((2, 3), np.float32)
  k[:, 0] *= 2
  np.testing.assert_allclose(agg.estimate_class_dist(k), [0.5, 0.25, 0.25], rtol=1e-6)


def test_estimate_class_dist_gradient_finite_at_zero():
  kernel = jnp.zeros((3, 4)).at[:, 0].set(1.0)
  grad = jax.jit(jax.grad(lambda x: jnp.sum(agg.estimate_class_dist(x) ** 2)))(kernel)
  assert np.all(np.isfinite(grad))


def test_cw_fedavg_bfloat16_rounds_once():
  # K < M takes the factored order (class models first): the class models must
  # stay in float32, so the bf16 result is the exact result rounded once.
  rng = np.random.default_rng(7)
  w = jnp.asarray(rng.normal(size=(8, 64)), jnp.bfloat16)
  counts = rng.integers(1, 9, size=(8, 2))
  out = jax.jit(agg.cw_fedavg)({"w": w}, counts)["w"]
  assert out.dtype == jnp.bfloat16
  exact = ref.cw_fedavg_ref({"w": np.asarray(w, np.float64)}, counts)["w"]
  ulp = 2.0 ** (np.floor(np.log2(np.abs(exact))) - 7)
  err = np.abs(np.asarray(out, np.float64) - exact)
  assert np.all(err <= 0.5 * ulp + 1e-6)


# ----------------------------------------------- cwFedAvg special cases (Sec. 4.3)


def test_cw_fedavg_iid_equals_fedavg(m=5, k=4):
  rng = np.random.default_rng(1)
  params = ref.random_params(rng, m)
  shape = np.array([3, 1, 0, 2])                 # the same distribution everywhere
  scale = np.array([1, 2, 3, 5, 8])
  counts = scale[:, None] * shape[None, :]
  out = jax.jit(agg.cw_fedavg)(params, counts)
  fedavg = ref.fedavg_ref(params, scale)
  assert_tree_close(out, jax.tree.map(lambda x: np.stack([x] * m), fedavg), 1e-5, 1e-5)


def test_cw_fedavg_one_class_per_client():
  # Eq. (9): class model j = FedAvg of the clients holding class j.
  rng = np.random.default_rng(2)
  labels = np.array([0, 2, 0, 1, 2, 0])
  n = np.array([3, 5, 1, 4, 2, 6])
  m, k = len(labels), 4                          # class 3 is held by nobody
  counts = np.zeros((m, k), np.int32)
  counts[np.arange(m), labels] = n
  params = ref.random_params(rng, m)
  models = jax.jit(agg.class_models)(params, counts)
  out = jax.jit(agg.cw_fedavg)(params, counts)
  for j in range(3):
    holders = labels == j
    group = jax.tree.map(lambda x: x[holders], params)
    expected = ref.fedavg_ref(group, n[holders])
    assert_tree_close(jax.tree.map(lambda x: x[j], models), expected, 1e-5, 1e-5)
    for i in np.flatnonzero(holders):
      assert_tree_close(jax.tree.map(lambda x: x[i], out), expected, 1e-5, 1e-5)
  # [settled] the absent class gets FedAvg weights.
  assert_tree_close(jax.tree.map(lambda x: x[3], models), ref.fedavg_ref(params, n),
                    1e-5, 1e-5)


def test_cw_fedavg_one_client_per_class_keeps_own_model():
  rng = np.random.default_rng(3)
  params = ref.random_params(rng, 4)
  counts = np.diag([5, 1, 7, 2])
  assert_tree_close(agg.cw_fedavg(params, counts), params, 1e-6, 1e-6)


# ---------------------------------------------------------------------- FedDWA


def _dwa_inputs(rng, m):
  params = ref.random_params(rng, m)
  received = jax.tree.map(
      lambda x: (x + rng.normal(size=x.shape) * 0.3).astype(np.float32), params)
  return params, received


@pytest.mark.parametrize("transform,m", ref.sweep([1, 2, 6], [4]))
def test_feddwa_matches_reference(transform, m):
  rng = np.random.default_rng(m)
  params, received = _dwa_inputs(rng, m)
  if m > 2:                                       # a client with a zero update
    for r, p in zip(jax.tree.leaves(received), jax.tree.leaves(params)):
      r[1] = p[1]
  fn = transform(lambda p, r, a, t: agg.feddwa(p, r, alpha=a, temperature=t))
  for alpha, temperature in [(0.2, 1.0), (0.7, 0.25), (0.0, 2.0)]:
    out = fn(params, received, alpha, temperature)
    assert_tree_close(out, ref.feddwa_ref(params, received, alpha, temperature))
  assert_tree_close(transform(agg.feddwa)(params, received),
                    ref.feddwa_ref(params, received))


def test_feddwa_mixes_trained_models_and_rows_sum_to_one():
  rng = np.random.default_rng(4)
  params, received = _dwa_inputs(rng, 4)
  received = jax.tree.map(lambda r: r + 100.0, received)   # far from the outputs
  np.testing.assert_allclose(ref.feddwa_weights_ref(params, received).sum(axis=1), 1.0)
  ones = jax.tree.map(np.ones_like, params)
  assert_tree_close(jax.jit(agg.feddwa)(ones, received), ones, 1e-6, 1e-6)
  out = jax.jit(agg.feddwa)(params, received)
  assert_tree_close(out, ref.feddwa_ref(params, received))
  # Each output is a convex combination of the trained models (|x| bounded).
  bound = ref.map_leaves(lambda x: np.abs(x).max(axis=0), params)
  for o, b in zip(jax.tree.leaves(out), jax.tree.leaves(bound)):
    assert np.all(np.abs(o) <= b + 1e-5)


def test_feddwa_identity_cases():
  rng = np.random.default_rng(5)
  params, received = _dwa_inputs(rng, 1)
  assert_tree_close(agg.feddwa(params, received), params, 0, 0)
  params, received = _dwa_inputs(rng, 4)
  assert_tree_close(agg.feddwa(params, received, alpha=1.0), params, 1e-6, 1e-6)


def test_feddwa_gradients_finite_with_zero_update():
  rng = np.random.default_rng(6)
  params, received = _dwa_inputs(rng, 4)
  params = jax.tree.map(jnp.asarray, params)
  loss = lambda p, r: sum(jnp.sum(x ** 2) for x in jax.tree.leaves(agg.feddwa(p, r)))
  grad = jax.jit(jax.grad(loss))
  for r in (params, received):                  # all updates zero / none zero
    for g in jax.tree.leaves(grad(params, r)):
      assert np.all(np.isfinite(g))
  small = {"w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32)}
  start = {"w": small["w"] + jnp.asarray(rng.normal(size=(3, 4)), jnp.float32)}
  jtu.check_grads(
      jax.jit(lambda p: agg.feddwa(p, start, alpha=0.3)["w"]), (small,), order=1,
      modes=("rev",), atol=5e-2, rtol=5e-2, eps=1e-2)


# ------------------------------------------------- issue 11: magnitudes and dtypes


def test_counts_near_float32_max():
  # Their sums overflow float32: today's fedavg returned zeros and cw_fedavg NaN.
  rng = np.random.default_rng(8)
  params = ref.random_params(rng, 3)
  n = np.array([3e38, 1e38, 2e38], np.float32)
  assert_tree_close(agg.fedavg(params, n), ref.fedavg_ref(params, n))
  assert_tree_close(agg.fedclassavg(params, n), ref.fedclassavg_ref(params, n))
  counts = np.array([[3e38, 1e38], [1e38, 3e38], [2e38, 0.0]], np.float32)
  assert_tree_close(agg.cw_fedavg(params, counts), ref.cw_fedavg_ref(params, counts))
  assert_tree_close(agg.class_models(params, counts),
                    ref.class_models_ref(params, counts))
  models = ref.class_models_ref(params, counts)
  assert_tree_close(agg.personalize(jax.tree.map(np.float32, models), counts),
                    ref.personalize_ref(models, counts))


@pytest.mark.parametrize("scale", [1e19, 1e30, 1e-30])
def test_estimate_class_dist_any_magnitude(scale):
  rng = np.random.default_rng(9)
  kernel = (rng.normal(size=(2, 6, 4)) * scale).astype(np.float32)
  out = agg.estimate_class_dist(kernel)
  np.testing.assert_allclose(out, ref.estimate_class_dist_ref(kernel), rtol=1e-5)
  grad = jax.grad(lambda k: jnp.sum(agg.estimate_class_dist(k)[0] ** 2))(kernel)
  assert np.all(np.isfinite(grad))


def test_float64_parameters_get_float64_weights():
  # docs/methods.md, common rules: weights in the wider dtype. Float32 weights (1/3 rounded)
  # give a relative error of ~3e-8; float64 ones agree to ~1e-15.
  with jax.enable_x64(True):
    rng = np.random.default_rng(10)
    params = ref.random_params(rng, 3, dtype=np.float64)
    n = np.array([1.0, 1.0, 1.0])
    counts = rng.integers(1, 9, size=(3, 4)).astype(np.float64)
    received = jax.tree.map(lambda x: x + rng.normal(size=x.shape), params)
    close = functools.partial(assert_tree_close, rtol=1e-12, atol=1e-12)
    close(agg.fedavg(params, n), ref.fedavg_ref(params, n))
    close(ptree.weighted_mean(params, n), ref.fedavg_ref(params, n))
    close(agg.fedclassavg(params, n), ref.fedclassavg_ref(params, n))
    close(agg.cw_fedavg(params, counts), ref.cw_fedavg_ref(params, counts))
    close(agg.class_models(params, counts), ref.class_models_ref(params, counts))
    close(agg.personalize(params, counts[:, :3]),
          ref.personalize_ref(params, counts[:, :3]))
    close(agg.feddwa(params, received), ref.feddwa_ref(params, received))
    kernel = params["classifier"]["output"]["kernel"]
    np.testing.assert_allclose(agg.estimate_class_dist(kernel),
                               ref.estimate_class_dist_ref(kernel), rtol=1e-12)
    assert agg.fedavg(params, n)["features"]["dense"].dtype == jnp.float64


def test_eager_calls_run_one_compiled_program():
  # Issue 11, item 17: without an outer jit, each public function validates on
  # the host and runs one jitted program, instead of dispatching (and, on new
  # shapes, compiling) every primitive separately. Fresh shapes (M = 7 and odd
  # leaf sizes, used nowhere else) count the programs compiled by a first call.
  rng = np.random.default_rng(11)
  m = 7
  params = {"features": {"w": rng.normal(size=(m, 3, 13)).astype(np.float32)},
            "classifier": {"b": rng.normal(size=(m, 17)).astype(np.float32)}}
  received = jax.tree.map(lambda x: x + 1.0, params)
  n = np.arange(1.0, m + 1, dtype=np.float32)
  counts = rng.integers(1, 5, size=(m, 11)).astype(np.float32)
  calls = {
      "fedavg": lambda: agg.fedavg(params, n),
      "fedclassavg": lambda: agg.fedclassavg(params, n),
      "cw_fedavg": lambda: agg.cw_fedavg(params, counts),
      "class_models": lambda: agg.class_models(params, counts),
      "personalize": lambda: agg.personalize(params, counts[:5, :m]),
      "estimate_class_dist": lambda: agg.estimate_class_dist(params["features"]["w"]),
      "feddwa": lambda: agg.feddwa(params, received),
      "mix": lambda: ptree.mix(np.ones((3, m), np.float32), params),
      "weighted_mean": lambda: ptree.weighted_mean(params, n),
      "cosine_similarity": lambda: ptree.cosine_similarity(params),
      "finite_clients": lambda: ptree.finite_clients(params),
  }
  compiled = []

  def listener(event, duration, **kwargs):
    del duration, kwargs
    if event == "/jax/core/compile/backend_compile_duration":
      compiled.append(event)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    for name, call in calls.items():
      compiled.clear()
      jax.block_until_ready(call())
      # One program, plus at most one for staging a NumPy input (feddwa's
      # second is its finiteness check of `received`).
      assert len(compiled) <= 2, (name, len(compiled))
      compiled.clear()
      jax.block_until_ready(call())
      assert not compiled, name
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def test_masked_clients_statistics_are_ignored_under_jit():
  # A masked client's class counts may be garbage (NaN) like its parameters:
  # the unmasked clients get exactly their subset's result.
  rng = np.random.default_rng(12)
  params = ref.random_params(rng, 4)
  counts = _counts(rng, 4, 3).astype(np.float32)
  counts[1] = np.nan
  mask = np.array([True, False, True, True])
  keep = np.flatnonzero(mask)
  subset = jax.tree.map(lambda x: x[keep], params)
  out = jax.jit(agg.cw_fedavg)(params, counts, mask=mask)
  assert_tree_close(jax.tree.map(lambda x: x[keep], out),
                    ref.cw_fedavg_ref(subset, counts[keep]))
  assert_tree_close(jax.jit(agg.class_models)(params, counts, mask=mask),
                    ref.class_models_ref(subset, counts[keep]))
