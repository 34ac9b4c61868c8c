"""Tests for pflax.losses against independent NumPy references and hand values."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import test_util as jtu

from pflax import losses

# check_grads on float32 (the losses compute in float32): a coarse step and a
# matching tolerance; the checked functions are jitted to keep the test fast.
_GRAD_KW = dict(order=1, modes=("fwd", "rev"), eps=1e-3, atol=2e-2, rtol=2e-2)


def _maybe_jit(fn, jit, **static):
  fn = functools.partial(fn, **static) if static else fn
  return jax.jit(fn) if jit else fn


def _all_finite(tree) -> bool:
  return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree))


# ---------------------------------------------------------------- references


def np_estimate_class_dist(kernel):
  norms = np.sqrt(np.sum(np.square(np.asarray(kernel, np.float64)), axis=0))
  total = norms.sum()
  return np.full_like(norms, 1 / norms.size) if total == 0 else norms / total


def np_wdr(kernel, class_dist):
  p = np.asarray(class_dist, np.float64)
  p = np.full_like(p, 1 / p.size) if p.sum() == 0 else p / p.sum()
  return np.linalg.norm(p - np_estimate_class_dist(kernel))


def np_proximal(params, anchor, reduce):
  terms = [np.square(np.asarray(p, np.float64) - np.asarray(a, np.float64))
           for p, a in zip(jax.tree.leaves(params), jax.tree.leaves(anchor))]
  return 0.5 * sum(t.sum() if reduce == "sum" else t.mean() for t in terms)


def np_cross_entropy(logits, labels, mask=None):
  logits = np.asarray(logits, np.float64)
  mask = np.ones(len(labels), bool) if mask is None else np.asarray(mask)
  total, count = 0.0, 0
  for row, label, valid in zip(logits, labels, mask):
    if valid:
      top = row.max()
      total -= row[label] - top - np.log(np.exp(row - top).sum())
      count += 1
  return total / max(count, 1)


def np_supcon(features, labels, temperature, base_temperature, mask=None):
  """Khosla et al. (2020) L_out, one anchor at a time."""
  z = np.asarray(features, np.float64)
  n = len(labels)
  mask = np.ones(n, bool) if mask is None else np.asarray(mask)
  per_anchor = []
  for i in range(n):
    if not mask[i]:
      continue
    contrast = [a for a in range(n) if a != i and mask[a]]
    positives = [p for p in contrast if labels[p] == labels[i]]
    if not positives:
      continue
    logits = {a: z[i] @ z[a] / temperature for a in contrast}
    top = max(logits.values())
    log_den = top + np.log(sum(np.exp(v - top) for v in logits.values()))
    mean_log_prob = np.mean([logits[p] - log_den for p in positives])
    per_anchor.append(-(temperature / base_temperature) * mean_log_prob)
  return float(np.mean(per_anchor)) if per_anchor else 0.0


def _two_views(key, batch, dim, num_classes):
  """Features of two augmented views stacked along the batch, and their labels."""
  k1, k2, k3 = jax.random.split(key, 3)
  labels = jax.random.randint(k1, (batch,), 0, num_classes)
  view_1 = jax.random.normal(k2, (batch, dim))
  view_2 = view_1 + 0.3 * jax.random.normal(k3, (batch, dim))
  return jnp.concatenate([view_1, view_2]), jnp.concatenate([labels, labels])


# ----------------------------------------------------------------------- wdr


@pytest.mark.parametrize("jit", [False, True])
def test_wdr_matches_numpy(jit):
  kernel = jax.random.normal(jax.random.key(0), (16, 5))
  counts = jnp.array([10.0, 0.0, 3.0, 7.0, 1.0])
  got = _maybe_jit(losses.wdr, jit)(kernel, counts)
  np.testing.assert_allclose(got, np_wdr(kernel, counts), rtol=1e-5)
  assert got.shape == () and got.dtype == jnp.float32


def test_wdr_hand_value():
  # Column norms 3 and 1 -> p~ = (0.75, 0.25); p = (0.5, 0.5).
  kernel = jnp.array([[3.0, 0.0], [0.0, 1.0]])
  np.testing.assert_allclose(losses.wdr(kernel, jnp.array([1, 1])),
                             0.25 * np.sqrt(2), rtol=1e-6)


def test_wdr_uses_norms_over_input_axis_not_squared():
  # Columns (3, 4) and (0, 5) both have norm 5: p~ uniform although the squared
  # entries and the row norms differ.
  kernel = jnp.array([[3.0, 0.0], [4.0, 5.0]])
  np.testing.assert_allclose(losses.wdr(kernel, jnp.array([1.0, 1.0])), 0.0, atol=1e-7)


def test_wdr_normalises_counts():
  kernel = jax.random.normal(jax.random.key(1), (8, 4))
  counts = jnp.array([4.0, 2.0, 1.0, 1.0])
  np.testing.assert_allclose(losses.wdr(kernel, counts),
                             losses.wdr(kernel, counts / counts.sum()), rtol=1e-6)


def test_wdr_zero_class_dist_is_uniform():
  kernel = jax.random.normal(jax.random.key(2), (8, 4))
  np.testing.assert_allclose(losses.wdr(kernel, jnp.zeros(4)),
                             losses.wdr(kernel, jnp.ones(4)), rtol=1e-6)


def test_wdr_grads_match_finite_differences():
  kernel = jax.random.normal(jax.random.key(3), (6, 4))
  counts = jnp.array([5.0, 1.0, 2.0, 0.0])
  jtu.check_grads(jax.jit(lambda k: losses.wdr(k, counts)), (kernel,), **_GRAD_KW)


def test_wdr_grad_finite_where_p_equals_estimate():
  counts = jnp.array([2.0, 1.0, 1.0])
  # Column j is 3 * p_j * e_j: column norms are exactly proportional to p.
  kernel = jnp.diag(3.0 * counts / counts.sum())
  assert float(losses.wdr(kernel, counts)) == 0.0
  grad = jax.grad(losses.wdr)(kernel, counts)
  assert _all_finite(grad)
  np.testing.assert_array_equal(grad, 0.0)


def test_wdr_grad_finite_at_zero_kernel():
  counts = jnp.array([3.0, 1.0, 0.0])
  value, grad = jax.value_and_grad(losses.wdr)(jnp.zeros((5, 3)), counts)
  np.testing.assert_allclose(value, np_wdr(np.zeros((5, 3)), counts), rtol=1e-6)
  assert _all_finite(grad)


def test_wdr_grad_finite_at_zero_column():
  kernel = jax.random.normal(jax.random.key(4), (5, 3)).at[:, 1].set(0.0)
  grad = jax.grad(losses.wdr)(kernel, jnp.array([1.0, 1.0, 1.0]))
  assert _all_finite(grad)


def test_wdr_vmaps_over_clients():
  kernels = jax.random.normal(jax.random.key(5), (3, 7, 4))
  counts = jnp.array([[1, 2, 3, 4], [4, 0, 0, 1], [0, 0, 0, 9]], jnp.float32)
  got = jax.vmap(losses.wdr)(kernels, counts)
  np.testing.assert_allclose(got, [np_wdr(k, c) for k, c in zip(kernels, counts)],
                             rtol=1e-5)


def test_wdr_rejects_bad_inputs():
  kernel = jnp.ones((8, 4))
  with pytest.raises(ValueError, match="class_dist"):
    losses.wdr(kernel, jnp.ones(5))
  with pytest.raises(ValueError, match="class_dist"):
    losses.wdr(kernel, jnp.array([1.0, -1.0, 0.0, 0.0]))
  with pytest.raises(ValueError, match="class_dist"):
    losses.wdr(kernel, jnp.array([1.0, jnp.nan, 0.0, 0.0]))
  with pytest.raises(ValueError, match="kernel"):
    losses.wdr(jnp.ones(4), jnp.ones(4))
  with pytest.raises(ValueError, match="kernel"):
    losses.wdr(jnp.ones((2, 8, 4)), jnp.ones(4))


# ------------------------------------------------------------------ proximal


def _trees(key):
  k1, k2, k3, k4 = jax.random.split(key, 4)
  params = {"dense": {"kernel": jax.random.normal(k1, (4, 3)),
                      "bias": jax.random.normal(k2, (3,))},
            "scale": jax.random.normal(k3, ())}
  anchor = jax.tree.map(lambda x, k: x + jax.random.normal(k, jnp.shape(x)), params,
                        {"dense": {"kernel": k4, "bias": k1}, "scale": k2})
  return params, anchor


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_proximal_matches_numpy(reduce, jit):
  params, anchor = _trees(jax.random.key(0))
  got = _maybe_jit(losses.proximal, jit, reduce=reduce)(params, anchor)
  np.testing.assert_allclose(got, np_proximal(params, anchor, reduce), rtol=1e-5)
  assert got.shape == () and got.dtype == jnp.float32


def test_proximal_hand_values():
  params = {"a": jnp.array([1.0, 3.0]), "b": jnp.array([[2.0]])}
  anchor = {"a": jnp.array([0.0, 1.0]), "b": jnp.array([[0.0]])}
  # Squared differences: a -> (1, 4), b -> (4).
  np.testing.assert_allclose(losses.proximal(params, anchor), 0.5 * 9.0)
  np.testing.assert_allclose(losses.proximal(params, anchor, "mean"), 0.5 * (2.5 + 4.0))


def test_proximal_default_is_sum():
  params, anchor = _trees(jax.random.key(1))
  assert losses.proximal(params, anchor) == losses.proximal(params, anchor, "sum")


def test_proximal_gradient_is_the_difference():
  params, anchor = _trees(jax.random.key(2))
  grad = jax.grad(losses.proximal)(params, anchor)
  jax.tree.map(lambda g, p, a: np.testing.assert_allclose(g, p - a, rtol=1e-6),
               grad, params, anchor)
  jtu.check_grads(jax.jit(lambda p: losses.proximal(p, anchor, "mean")), (params,),
                  **_GRAD_KW)


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_proximal_grad_finite_at_anchor(reduce):
  params, _ = _trees(jax.random.key(3))
  value, grad = jax.value_and_grad(losses.proximal)(params, params, reduce)
  assert float(value) == 0.0
  assert _all_finite(grad)
  jax.tree.map(lambda g: np.testing.assert_array_equal(g, 0.0), grad)


def test_proximal_bfloat16_accumulates_in_float32():
  params = {"w": jnp.full((1000,), 1.0, jnp.bfloat16)}
  anchor = {"w": jnp.zeros((1000,), jnp.bfloat16)}
  got = losses.proximal(params, anchor)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, 500.0)


def test_proximal_rejects_bad_inputs():
  params, anchor = _trees(jax.random.key(4))
  with pytest.raises(ValueError, match="reduce"):
    losses.proximal(params, anchor, "max")
  with pytest.raises(ValueError, match="anchor"):
    losses.proximal(params, {"dense": anchor["dense"]})
  with pytest.raises(ValueError, match="anchor"):
    losses.proximal(params, {**anchor, "scale": jnp.zeros(2)})


# ------------------------------------------------------------- cross_entropy


@pytest.mark.parametrize("jit", [False, True])
def test_cross_entropy_matches_numpy(jit):
  k1, k2 = jax.random.split(jax.random.key(0))
  logits = 5.0 * jax.random.normal(k1, (12, 7))
  labels = jax.random.randint(k2, (12,), 0, 7)
  got = _maybe_jit(losses.cross_entropy, jit)(logits, labels)
  np.testing.assert_allclose(got, np_cross_entropy(logits, labels), rtol=1e-5)
  assert got.shape == () and got.dtype == jnp.float32


@pytest.mark.parametrize("jit", [False, True])
def test_cross_entropy_mask_averages_over_valid_examples(jit):
  k1, k2 = jax.random.split(jax.random.key(1))
  logits = jax.random.normal(k1, (10, 4))
  labels = jax.random.randint(k2, (10,), 0, 4)
  mask = jnp.arange(10) < 6
  padded = logits.at[6:].set(1e4)  # padding content must not matter
  got = _maybe_jit(losses.cross_entropy, jit)(padded, labels, mask)
  np.testing.assert_allclose(got, np_cross_entropy(logits[:6], labels[:6]), rtol=1e-5)
  np.testing.assert_allclose(got, np_cross_entropy(logits, labels, mask), rtol=1e-5)


def test_cross_entropy_hand_value():
  logits = jnp.array([[0.0, 0.0], [jnp.log(3.0), 0.0]])
  # Uniform -> log 2; p(label 0) = 3/4 -> log(4/3).
  np.testing.assert_allclose(losses.cross_entropy(logits, jnp.array([1, 0])),
                             0.5 * (np.log(2) + np.log(4 / 3)), rtol=1e-6)


def test_cross_entropy_no_valid_example_is_zero():
  logits = jnp.ones((3, 2))
  value, grad = jax.value_and_grad(losses.cross_entropy)(
      logits, jnp.zeros(3, jnp.int32), jnp.zeros(3, bool))
  assert float(value) == 0.0
  np.testing.assert_array_equal(grad, 0.0)


def test_cross_entropy_grads():
  k1, k2 = jax.random.split(jax.random.key(2))
  logits = jax.random.normal(k1, (6, 5))
  labels = jax.random.randint(k2, (6,), 0, 5)
  mask = jnp.array([True, False, True, True, False, True])
  loss = jax.jit(lambda x: losses.cross_entropy(x, labels, mask))
  jtu.check_grads(loss, (logits,), **_GRAD_KW)
  grad = jax.grad(losses.cross_entropy)(logits, labels, mask)
  np.testing.assert_array_equal(grad[~mask], 0.0)
  # Softmax minus one-hot, averaged over the valid examples.
  expected = (jax.nn.softmax(logits) - jax.nn.one_hot(labels, 5)) / 4
  np.testing.assert_allclose(grad[mask], expected[mask], rtol=1e-5, atol=1e-7)


def test_cross_entropy_rejects_bad_inputs():
  with pytest.raises(ValueError, match="labels"):
    losses.cross_entropy(jnp.ones((4, 3)), jnp.zeros(5, jnp.int32))
  with pytest.raises(ValueError, match="logits"):
    losses.cross_entropy(jnp.ones(4), jnp.zeros(4, jnp.int32))
  with pytest.raises(ValueError, match="mask"):
    losses.cross_entropy(jnp.ones((4, 3)), jnp.zeros(4, jnp.int32), jnp.ones(3, bool))


# -------------------------------------------------------------------- supcon


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("temperature,base_temperature,normalise", [
    (0.07, 0.07, True),     # Khosla et al.'s setting
    (0.5, 0.07, True),
    (100.0, 0.07, False),   # FedClassAvg's authors' code: unnormalised features
])
def test_supcon_matches_numpy(temperature, base_temperature, normalise, jit):
  features, labels = _two_views(jax.random.key(0), batch=8, dim=5, num_classes=3)
  if normalise:
    features = features / jnp.linalg.norm(features, axis=1, keepdims=True)
  got = _maybe_jit(losses.supcon, jit)(features, labels, temperature, base_temperature)
  want = np_supcon(features, labels, temperature, base_temperature)
  np.testing.assert_allclose(got, want, rtol=1e-4)
  assert got.shape == () and got.dtype == jnp.float32


def test_supcon_hand_value():
  # z0 = z1 = e1 (label 0), z2 = e2 (label 1), T = T_b = 1: anchors 0 and 1 each
  # have one positive with logit 1 against {1, 0}: -log(e / (e + 1)); anchor 2
  # has no positive and is excluded.
  features = jnp.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
  got = losses.supcon(features, jnp.array([0, 0, 1]), 1.0, 1.0)
  np.testing.assert_allclose(got, np.log1p(np.exp(-1.0)), rtol=1e-6)


def test_supcon_scales_with_temperature_ratio():
  features, labels = _two_views(jax.random.key(1), batch=6, dim=4, num_classes=2)
  base = losses.supcon(features, labels, 0.5, 0.5)
  np.testing.assert_allclose(losses.supcon(features, labels, 0.5, 0.25), 2.0 * base,
                             rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_supcon_mask_excludes_padded_examples(jit):
  features, labels = _two_views(jax.random.key(2), batch=8, dim=6, num_classes=3)
  mask = jnp.ones(16, bool).at[jnp.array([3, 11, 12])].set(False)
  padded = jnp.where(mask[:, None], features, 50.0)   # garbage in padded rows
  got = _maybe_jit(losses.supcon, jit)(padded, labels, 0.5, 0.07, mask)
  want = np_supcon(features[mask], labels[mask], 0.5, 0.07)
  np.testing.assert_allclose(got, want, rtol=1e-4)
  np.testing.assert_allclose(got, np_supcon(features, labels, 0.5, 0.07, mask),
                             rtol=1e-4)


def test_supcon_anchors_without_positives_are_excluded():
  # Label 2 appears once: that anchor has no positive and must not count.
  features = jax.random.normal(jax.random.key(3), (5, 3))
  labels = jnp.array([0, 1, 0, 1, 2])
  got = losses.supcon(features, labels, 1.0, 1.0)
  np.testing.assert_allclose(got, np_supcon(features, labels, 1.0, 1.0), rtol=1e-5)
  with_single = losses.supcon(features[:4], labels[:4], 1.0, 1.0)
  assert not np.isclose(got, with_single)  # the singleton still contrasts


def test_supcon_no_positive_anywhere_is_zero():
  features = jax.random.normal(jax.random.key(4), (4, 3))
  value, grad = jax.value_and_grad(losses.supcon)(features, jnp.arange(4))
  assert float(value) == 0.0
  assert _all_finite(grad)


def test_supcon_grads_match_finite_differences():
  features, labels = _two_views(jax.random.key(5), batch=4, dim=3, num_classes=2)
  mask = jnp.ones(8, bool).at[5].set(False)
  loss = jax.jit(lambda z: losses.supcon(z, labels, 1.0, 0.5, mask))
  jtu.check_grads(loss, (features,), **_GRAD_KW)


def test_supcon_grad_finite_with_zero_feature_vector():
  features, labels = _two_views(jax.random.key(6), batch=4, dim=3, num_classes=2)
  features = features.at[2].set(0.0).at[6].set(0.0)
  value, grad = jax.value_and_grad(losses.supcon)(features, labels, 0.1, 0.07)
  np.testing.assert_allclose(value, np_supcon(features, labels, 0.1, 0.07), rtol=1e-4)
  assert _all_finite(grad)
  zeros = jnp.zeros_like(features)
  assert _all_finite(jax.grad(losses.supcon)(zeros, labels, 0.1, 0.07))


def test_supcon_grad_zero_on_masked_rows():
  features, labels = _two_views(jax.random.key(7), batch=4, dim=3, num_classes=2)
  mask = jnp.array([True, True, False, True, True, True, False, True])
  grad = jax.grad(losses.supcon)(features * 30.0, labels, 0.07, 0.07, mask)
  assert _all_finite(grad)
  np.testing.assert_array_equal(grad[~mask], 0.0)
  assert np.any(grad[mask] != 0.0)


def test_supcon_rejects_bad_inputs():
  features = jnp.ones((6, 3))
  labels = jnp.zeros(6, jnp.int32)
  with pytest.raises(ValueError, match="labels"):
    losses.supcon(features, jnp.zeros(5, jnp.int32))
  with pytest.raises(ValueError, match="features"):
    losses.supcon(jnp.ones(6), labels)
  with pytest.raises(ValueError, match="temperature"):
    losses.supcon(features, labels, temperature=0.0)
  with pytest.raises(ValueError, match="temperature"):
    losses.supcon(features, labels, temperature=-1.0)
  with pytest.raises(ValueError, match="base_temperature"):
    losses.supcon(features, labels, base_temperature=0.0)
  with pytest.raises(ValueError, match="mask"):
    losses.supcon(features, labels, mask=jnp.ones(5, bool))
