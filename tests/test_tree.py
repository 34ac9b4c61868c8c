"""Tests for pflax.tree against NumPy and hand-built trees."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pflax import tree as ptree
from pflax._src.core import tree as tree_lib

import references as ref

TRANSFORMS = [pytest.param(ref.no_jit, id="nojit"), pytest.param(jax.jit, id="jit")]


def _params(m=4, seed=0):
  return ref.random_params(np.random.default_rng(seed), m)


def _assert_tree_close(actual, expected, rtol=1e-5, atol=1e-5):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    assert np.shape(a) == np.shape(e)
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(e, np.float64),
                               rtol=rtol, atol=atol)


def test_stack_unstack_round_trip():
  rng = np.random.default_rng(1)
  trees = [jax.tree.map(lambda x: rng.normal(size=x.shape[1:]).astype(np.float32),
                        _params(1)) for _ in range(3)]
  stacked = ptree.stack(trees)
  assert ptree.num_clients(stacked) == 3
  for leaf, parts in zip(jax.tree.leaves(stacked),
                         zip(*[jax.tree.leaves(t) for t in trees])):
    np.testing.assert_array_equal(leaf, np.stack(parts))
  back = ptree.unstack(stacked)
  assert len(back) == 3
  for a, b in zip(back, trees):
    _assert_tree_close(a, b, 0, 0)
  _assert_tree_close(ptree.stack(ptree.unstack(_params())), _params(), 0, 0)


def test_stack_rejects_mismatched_trees():
  with pytest.raises(ValueError, match="trees"):
    ptree.stack([])
  with pytest.raises(ValueError, match=r"trees\[1\]"):
    ptree.stack([{"a": np.zeros(3)}, {"a": np.zeros(4)}])
  with pytest.raises(ValueError, match=r"trees\[1\]"):
    ptree.stack([{"a": np.zeros(3)}, {"b": np.zeros(3)}])


def test_num_clients_and_mismatch_names_the_leaf():
  assert ptree.num_clients(_params(6)) == 6
  bad = {"conv_kernel": np.zeros((3, 2)), "head": {"bias_b": np.zeros((4,))}}
  with pytest.raises(ValueError, match="conv_kernel") as err:
    ptree.num_clients(bad)
  assert "bias_b" in str(err.value)
  with pytest.raises(ValueError, match="scalar_leaf"):
    ptree.num_clients({"scalar_leaf": np.float32(1.0), "x": np.zeros((2,))})


def test_broadcast():
  tree = {"a": np.arange(6.0).reshape(2, 3), "b": np.float32(2.0)}
  out = ptree.broadcast(tree, 4)
  assert out["a"].shape == (4, 2, 3) and out["b"].shape == (4,)
  for i in range(4):
    np.testing.assert_array_equal(out["a"][i], tree["a"])
    assert out["b"][i] == 2.0
  with pytest.raises(ValueError, match="num_clients"):
    ptree.broadcast(tree, 0)


@pytest.mark.parametrize("transform,m,o", ref.sweep([(1, 1), (3, 6)], [(4, 2)]))
def test_mix_matches_numpy(transform, m, o):
  params = _params(m, seed=m)
  weights = np.random.default_rng(o).normal(size=(o, m)).astype(np.float32)
  out = transform(ptree.mix)(weights, params)
  expected = ref.map_leaves(
      lambda x: np.stack([ref.weighted_sum(weights[r], x) for r in range(o)]), params)
  _assert_tree_close(out, expected)
  with pytest.raises(ValueError, match="weights"):
    ptree.mix(np.ones((o, m + 1)), params)


def test_mix_bfloat16_accumulates_in_float32():
  m = 300                     # 256 + 1 == 256 in bfloat16: a bf16 sum stalls
  stacked = {"x": jnp.ones((m, 2), jnp.bfloat16)}
  out = ptree.mix(jnp.ones((1, m), jnp.float32), stacked)["x"]
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out, np.float32), [[300.0, 300.0]])
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(64, 33)), jnp.bfloat16)
  w = rng.uniform(size=(3, 64)).astype(np.float32)
  out = ptree.mix(w, {"x": x})["x"]
  exact = w.astype(np.float64) @ np.asarray(x, np.float64)
  ulp = 2.0 ** (np.floor(np.log2(np.abs(exact))) - 7)
  assert out.dtype == jnp.bfloat16
  assert np.all(np.abs(np.asarray(out, np.float64) - exact) <= 0.51 * ulp)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_weighted_mean(transform, m=4):
  params = _params(m)
  w = np.array([1.0, 0.0, 3.0, 4.0], np.float32)
  _assert_tree_close(transform(ptree.weighted_mean)(params, w),
                     ref.fedavg_ref(params, w))
  _assert_tree_close(transform(ptree.weighted_mean)(params), ref.fedavg_ref(params))
  with pytest.raises(ValueError, match="weights"):
    ptree.weighted_mean(params, w[:3])
  with pytest.raises(ValueError, match="weights"):
    ptree.weighted_mean(params, -w)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_cosine_similarity_matches_concatenated_numpy(transform):
  params = jax.tree.map(lambda x: x.copy(), _params(4))
  for leaf in jax.tree.leaves(params):
    leaf[2] = 0.0
  cos = transform(ptree.cosine_similarity)(params)
  expected = ref.cosine_matrix(ref.flat_clients(params))
  assert cos.shape == (4, 4) and cos.dtype == jnp.float32
  np.testing.assert_allclose(cos, expected, atol=1e-5)
  np.testing.assert_array_equal(cos[2], np.zeros(4))     # the zero client
  np.testing.assert_array_equal(cos[:, 2], np.zeros(4))
  np.testing.assert_allclose(np.diagonal(cos)[[0, 1, 3]], 1.0, atol=1e-6)


def test_cosine_similarity_gradient_finite_with_zero_client():
  params = jax.tree.map(lambda x: jnp.asarray(x).at[0].set(0.0), _params(3))
  grads = jax.jit(jax.grad(lambda p: jnp.sum(ptree.cosine_similarity(p) ** 2)))(params)
  for g in jax.tree.leaves(grads):
    assert np.all(np.isfinite(g))


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_finite_clients(transform):
  params = jax.tree.map(lambda x: x.copy(), _params(4))
  params["features"]["conv"][1, 0, 2, 3] = np.nan
  params["classifier"]["output"]["bias"][3, 4] = -np.inf
  out = transform(ptree.finite_clients)(params)
  np.testing.assert_array_equal(out, [True, False, True, False])


def test_concat():
  a, b = _params(2, seed=1), _params(3, seed=2)
  out = ptree.concat([a, b])
  assert ptree.num_clients(out) == 5
  for x, y, z in zip(jax.tree.leaves(out), jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, np.concatenate([y, z]))
  with pytest.raises(ValueError, match="stacked_list"):
    ptree.concat([])
  with pytest.raises(ValueError, match=r"stacked_list\[1\]"):
    ptree.concat([a, {"other": np.zeros((2, 3))}])
  c = ref.random_params(np.random.default_rng(0), 2, k=4)
  with pytest.raises(ValueError, match=r"stacked_list\[1\].*bias"):
    ptree.concat([a, c])


def test_partition_combine_with_under():
  params = _params(3)
  selected, rest = ptree.partition(params, ptree.under("classifier"))
  assert selected["features"]["conv"] is None and selected["features"]["dense"] is None
  assert rest["classifier"]["output"]["kernel"] is None
  assert rest["classifier"]["output"]["bias"] is None
  np.testing.assert_array_equal(selected["classifier"]["output"]["kernel"],
                                params["classifier"]["output"]["kernel"])
  np.testing.assert_array_equal(rest["features"]["conv"], params["features"]["conv"])
  assert len(jax.tree.leaves(selected)) == 2 and len(jax.tree.leaves(rest)) == 2
  back = ptree.combine(selected, rest)
  assert jax.tree.structure(back) == jax.tree.structure(params)
  _assert_tree_close(back, params, 0, 0)
  # jax.tree.map over one half touches only its leaves.
  doubled = ptree.combine(jax.tree.map(lambda x: 2 * x, selected), rest)
  np.testing.assert_array_equal(doubled["classifier"]["output"]["bias"],
                                2 * params["classifier"]["output"]["bias"])
  np.testing.assert_array_equal(doubled["features"]["dense"], params["features"]["dense"])


def test_partition_combine_with_bool_pytree():
  params = _params(2)
  where = {"features": {"conv": True, "dense": False},
           "classifier": {"output": {"kernel": False, "bias": True}}}
  selected, rest = ptree.partition(params, where)
  assert selected["features"]["dense"] is None and rest["features"]["conv"] is None
  assert selected["classifier"]["output"]["kernel"] is None
  np.testing.assert_array_equal(selected["classifier"]["output"]["bias"],
                                params["classifier"]["output"]["bias"])
  _assert_tree_close(ptree.combine(selected, rest), params, 0, 0)
  with pytest.raises(ValueError, match="where"):
    ptree.partition(params, {"features": True})


def test_partition_flags_is_partition_by_the_resolved_selection():
  """The form the aggregators' jitted programs use (a static tuple of flags)."""
  params = _params(2)
  where = ptree.under("classifier", "output")
  flags = tuple(tree_lib.selection(params, where))
  for got, want in zip(jax.jit(tree_lib.partition_flags, static_argnums=1)(params, flags),
                       ptree.partition(params, where)):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    _assert_tree_close(got, want, 0, 0)


def _selected_paths(tree, where):
  selected, _ = ptree.partition(tree, where)
  paths = jax.tree_util.tree_leaves_with_path(selected)
  return sorted("/".join(str(k.key) for k in p) for p, _ in paths)


def test_under_multi_name_means_consecutive_modules():
  tree = {
      "params": {
          "classifier": {"output": {"kernel": 1.0, "bias": 2.0},
                         "hidden": {"kernel": 3.0}},
          "features": {"output": {"kernel": 4.0}},
          "output": {"classifier": {"kernel": 5.0}},
          "classifier_output": {"kernel": 6.0},
      }
  }
  assert _selected_paths(tree, ptree.under("classifier", "output")) == [
      "params/classifier/output/bias", "params/classifier/output/kernel"]
  assert _selected_paths(tree, ptree.under("classifier")) == [
      "params/classifier/hidden/kernel", "params/classifier/output/bias",
      "params/classifier/output/kernel", "params/output/classifier/kernel"]
  assert _selected_paths(tree, ptree.under("output")) == [
      "params/classifier/output/bias", "params/classifier/output/kernel",
      "params/features/output/kernel", "params/output/classifier/kernel"]
  with pytest.raises(ValueError):
    ptree.under()


# ------------------------------------------------------------------- issue 11


def test_required_selection_names_where_and_lists_keys():
  from pflax._src.core import tree as tree_lib       # the shared boundary helper
  tree = {"Conv_0": {"kernel": 1.0}, "Dense_0": {"kernel": 2.0, "bias": 3.0}}
  assert tree_lib.required_selection(tree, ptree.under("Dense_0")) == [
      False, True, True]
  assert tree_lib.required_selection(tree, None) == [True, True, True]
  with pytest.raises(ValueError, match=r"head selects no leaf.*\['Conv_0', 'Dense_0'\]"):
    tree_lib.required_selection(tree, ptree.under("Dense_9"), "head")
  with pytest.raises(ValueError, match=r"where selects no leaf"):
    tree_lib.required_selection(tree, jax.tree.map(lambda _: False, tree))
  # A Flax-style wrapper: the keys inside "params" are listed too.
  with pytest.raises(ValueError, match=r"\['params'\].*\['Conv_0', 'Dense_0'\]"):
    tree_lib.required_selection({"params": tree}, ptree.under("classifier"))


@pytest.mark.parametrize("scale", [1e25, 1e-25])
def test_cosine_similarity_at_extreme_magnitudes(scale):
  # Squares of 1e25 overflow float32 and squares of 1e-25 underflow; cosines
  # are scale invariant. Client 3's leaves span 1e25 .. 1e-25 at once.
  params = jax.tree.map(lambda x: (x * scale).astype(np.float32), _params(4))
  params["features"]["dense"][3] *= 1e-20 if scale > 1 else 1e20
  out = ptree.cosine_similarity(params, eps=0.0)
  expected = ref.cosine_matrix(ref.flat_clients(params))
  assert np.all(np.isfinite(out))
  np.testing.assert_allclose(out, expected, atol=1e-5)


def test_weighted_mean_of_counts_near_float32_max():
  params = _params(3)
  w = np.array([3e38, 1e38, 2e38], np.float32)   # their sum overflows float32
  _assert_tree_close(ptree.weighted_mean(params, w), ref.fedavg_ref(params, w))
