"""Tests for pflax.models against hand counts and a NumPy reference forward."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pflax import models


def _num_params(tree) -> int:
  return sum(int(np.size(leaf)) for leaf in jax.tree.leaves(tree))


def _abstract_params(model, input_shape):
  x = jax.ShapeDtypeStruct((1, *input_shape), jnp.float32)
  return jax.eval_shape(model.init, jax.random.key(0), x)["params"]


def _shapes(tree):
  return jax.tree.map(np.shape, tree)


def _apply(model, params, x, method="__call__"):
  """Jitted ``model.apply``: one compilation instead of one per eager op."""
  return jax.jit(lambda p, x: model.apply({"params": p}, x, method=method))(params, x)


def _random_params(model, input_shape, seed=0, num_clients=None):
  """NumPy-drawn parameters (no PRNG compilation), optionally client-stacked."""
  rng = np.random.default_rng(seed)
  lead = () if num_clients is None else (num_clients,)
  return jax.tree.map(
      lambda s: (0.3 * rng.standard_normal(lead + s.shape)).astype(np.float32),
      _abstract_params(model, input_shape))


def _np_conv_relu_pool(x, kernel, bias, padding):
  """NHWC conv (stride 1) + ReLU + 2x2 max-pool with floor, in NumPy."""
  kh, kw = kernel.shape[:2]
  if padding == "SAME":
    ph, pw = kh - 1, kw - 1
    x = np.pad(x, ((0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2), (0, 0)))
  windows = np.lib.stride_tricks.sliding_window_view(x, (kh, kw), axis=(1, 2))
  y = np.maximum(np.einsum("bhwcij,ijco->bhwo", windows, kernel) + bias, 0.0)
  b, h, w, c = y.shape
  y = y[:, : h // 2 * 2, : w // 2 * 2]
  return y.reshape(b, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


def _np_dense_stack(h, layers):
  """ReLU after every layer but the last."""
  for i, layer in enumerate(layers):
    h = h @ np.asarray(layer["kernel"]) + np.asarray(layer["bias"])
    if i < len(layers) - 1:
      h = np.maximum(h, 0.0)
  return h


def _np_cnn(params, x, padding):
  h = np.asarray(x, np.float64)
  feats = params["features"]
  for i in range(len(feats)):
    conv = feats[f"conv_{i}"]
    h = _np_conv_relu_pool(h, np.asarray(conv["kernel"]), np.asarray(conv["bias"]), padding)
  h = h.reshape(h.shape[0], -1)
  cls = params["classifier"]
  return _np_dense_stack(h, [cls["hidden_0"], cls["output"]])


def _np_mlp(params, x):
  h = np.asarray(x, np.float64).reshape(x.shape[0], -1)
  cls = params["classifier"]
  hidden = [cls[f"hidden_{i}"] for i in range(len(cls) - 1)]
  return _np_dense_stack(h, [params["features"]["dense_0"], *hidden, cls["output"]])


def _flax_max_pool(x):
  return nn.max_pool(x, (2, 2), strides=(2, 2))


@pytest.mark.parametrize("shape", [(2, 8, 8, 3), (3, 7, 9, 2), (1, 5, 4, 1), (2, 1, 3, 4)])
def test_max_pool_2x2_equals_flax_max_pool(shape):
  # Continuous random inputs have no tied maxima, where gradients may differ.
  x = jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.float32)
  pooled = jax.jit(models.max_pool_2x2)(x)
  assert pooled.shape == (shape[0], shape[1] // 2, shape[2] // 2, shape[3])
  np.testing.assert_array_equal(pooled, _flax_max_pool(x))
  w = jnp.asarray(np.random.default_rng(1).standard_normal(pooled.shape), jnp.float32)
  grad = lambda pool: jax.jit(jax.grad(lambda x: jnp.sum(w * pool(x))))(x)
  np.testing.assert_array_equal(grad(models.max_pool_2x2), grad(_flax_max_pool))


def test_max_pool_2x2_matches_numpy_reference():
  x = np.random.default_rng(2).standard_normal((2, 7, 6, 3)).astype(np.float32)
  expected = x[:, :6].reshape(2, 3, 2, 3, 2, 3).max(axis=(2, 4))
  np.testing.assert_array_equal(models.max_pool_2x2(jnp.asarray(x)), expected)


@pytest.mark.parametrize(
    "input_shape, expected",
    [((32, 32, 3), 878_538), ((28, 28, 1), 582_026)],
)
def test_cnn_param_count(input_shape, expected):
  assert _num_params(_abstract_params(models.CNN(10), input_shape)) == expected


def test_mlp_param_count():
  params = _abstract_params(models.MLP(10), (784,))
  assert _num_params(params) == 784 * 200 + 200 + 200 * 200 + 200 + 200 * 10 + 10


def test_cnn_param_layout():
  params = _abstract_params(models.CNN(7), (28, 28, 1))
  assert _shapes(params) == {
      "features": {
          "conv_0": {"kernel": (5, 5, 1, 32), "bias": (32,)},
          "conv_1": {"kernel": (5, 5, 32, 64), "bias": (64,)},
      },
      "classifier": {
          "hidden_0": {"kernel": (1024, 512), "bias": (512,)},
          "output": {"kernel": (512, 7), "bias": (7,)},
      },
  }


def test_mlp_param_layout():
  params = _abstract_params(models.MLP(3, hidden=(16, 8, 4)), (5, 5, 1))
  assert _shapes(params) == {
      "features": {"dense_0": {"kernel": (25, 16), "bias": (16,)}},
      "classifier": {
          "hidden_0": {"kernel": (16, 8), "bias": (8,)},
          "hidden_1": {"kernel": (8, 4), "bias": (4,)},
          "output": {"kernel": (4, 3), "bias": (3,)},
      },
  }


@pytest.mark.parametrize("padding, size", [("VALID", 16), ("SAME", 8)])
def test_cnn_matches_numpy_reference(padding, size):
  model = models.CNN(5, channels=(4, 6), hidden=12, padding=padding)
  x = np.random.default_rng(1).standard_normal((3, size, size, 2)).astype(np.float32)
  params = _random_params(model, x.shape[1:])
  logits = _apply(model, params, x)
  assert logits.shape == (3, 5)
  np.testing.assert_allclose(logits, _np_cnn(params, x, padding), rtol=1e-4, atol=1e-4)


def test_mlp_matches_numpy_reference():
  model = models.MLP(4, hidden=(10, 9, 8))
  x = np.random.default_rng(1).standard_normal((6, 3, 3, 2)).astype(np.float32)
  params = _random_params(model, x.shape[1:])
  np.testing.assert_allclose(
      _apply(model, params, x), _np_mlp(params, x), rtol=1e-5, atol=1e-5)


_MODELS = [
    (models.CNN(10), (28, 28, 1)),
    (models.CNN(10, padding="SAME"), (8, 8, 1)),
    (models.MLP(10), (28, 28, 1)),
    *[(m, (8, 8, 1)) for m in models.heterogeneous_family(10, 32)],
]


@pytest.mark.parametrize("model, input_shape", _MODELS)
def test_head_and_embed_compose_to_model(model, input_shape):
  x = np.random.default_rng(1).uniform(size=(4, *input_shape)).astype(np.float32)
  params = _random_params(model, input_shape)

  @jax.jit
  def forward(p, x):
    h = model.apply({"params": p}, x, method="extract")
    head_logits = model.head().apply({"params": p["classifier"]}, h)
    z = model.apply({"params": p}, x, method="embed")
    return model.apply({"params": p}, x), h, head_logits, z

  logits, h, head_logits, z = forward(params, x)
  assert h.shape == (4, models.feature_dim(model, input_shape))
  np.testing.assert_allclose(head_logits, logits, rtol=1e-5, atol=1e-5)
  out = params["classifier"]["output"]
  assert z.shape == (4, out["kernel"].shape[0])
  np.testing.assert_allclose(z @ out["kernel"] + out["bias"], logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "model, width", [(models.CNN(10, hidden=64), 64), (models.MLP(10, hidden=(50, 30)), 30)]
)
def test_embed_width(model, width):
  x = jax.ShapeDtypeStruct((2, 28, 28, 1), jnp.float32)
  params = _abstract_params(model, x.shape[1:])
  z = jax.eval_shape(lambda p, x: model.apply({"params": p}, x, method="embed"), params, x)
  assert z.shape == (2, width)


@pytest.mark.parametrize("hidden", [(5,), (6, 5)])
def test_representation_is_the_last_hidden_layer_before_its_relu(hidden):
  # FedClassAvg's contrastive features: the authors' `fcin` output, pre-ReLU.
  model = models.MLP(3, hidden=(4, *hidden))
  x = np.random.default_rng(2).standard_normal((8, 6)).astype(np.float32)
  params = _random_params(model, (6,))
  c = params["classifier"]
  h = np.maximum(x @ params["features"]["dense_0"]["kernel"]
                 + params["features"]["dense_0"]["bias"], 0.0)
  expected = _np_dense_stack(h, [c[f"hidden_{i}"] for i in range(len(hidden))])
  z = _apply(model, params, x, method="representation")
  assert (expected < 0).any()  # the ReLU would change it
  np.testing.assert_allclose(z, expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(_apply(model, params, x, method="embed"),
                             np.maximum(expected, 0.0), rtol=1e-5, atol=1e-5)


def test_head_without_hidden_embeds_identity():
  h = np.random.default_rng(0).standard_normal((3, 7)).astype(np.float32)
  head = models.Head(4)
  params = _random_params(head, (7,))
  assert list(params) == ["output"]
  np.testing.assert_array_equal(_apply(head, params, h, method="embed"), h)
  np.testing.assert_array_equal(_apply(head, params, h, method="representation"), h)


@pytest.mark.parametrize(
    "model, input_shape, expected",
    [
        (models.CNN(10), (28, 28, 1), 1024),
        (models.CNN(10), (32, 32, 3), 1600),
        (models.CNN(10, padding="SAME"), (8, 8, 1), 256),
        (models.MLP(10), (784,), 200),
    ],
)
def test_feature_dim(model, input_shape, expected):
  assert models.feature_dim(model, input_shape) == expected


@pytest.mark.parametrize(
    "model, input_shape",
    [(models.CNN(10, channels=(4, 8), hidden=16), (16, 16, 1)), (models.MLP(10), (28, 28, 1))],
)
def test_vmapped_apply_equals_loop(model, input_shape):
  num_clients = 3
  xs = np.random.default_rng(1).uniform(size=(num_clients, 5, *input_shape)).astype(np.float32)
  stacked = _random_params(model, input_shape, num_clients=num_clients)
  batched = jax.jit(jax.vmap(model.apply))({"params": stacked}, xs)
  single = jax.jit(model.apply)
  for m in range(num_clients):
    params_m = jax.tree.map(lambda p, m=m: p[m], stacked)
    np.testing.assert_allclose(
        batched[m], single({"params": params_m}, xs[m]), rtol=1e-5, atol=1e-5)


# One random kernel keeps PRNG compilation (the bulk of init time on CPU) short.
_TINY, _TINY_X = models.Head(3), jnp.zeros((1, 2))
_TINY_INIT = jax.jit(_TINY.init)


def test_init_stacked_independent_clients():
  key = jax.random.key(3)
  stacked = models.init_stacked(_TINY, key, _TINY_X, num_clients=4)
  keys = jax.random.split(key, 4)
  for m in range(4):
    expected = _TINY_INIT(keys[m], _TINY_X)["params"]
    assert jax.tree.structure(stacked) == jax.tree.structure(expected)
    jax.tree.map(lambda s, e, m=m: np.testing.assert_allclose(s[m], e), stacked, expected)
  kernels = stacked["output"]["kernel"]
  assert kernels.shape == (4, 2, 3)
  assert not np.allclose(kernels[0], kernels[1])


def test_init_stacked_same_init():
  key = jax.random.key(3)
  stacked = models.init_stacked(_TINY, key, _TINY_X, num_clients=3, same_init=True)
  single = _TINY_INIT(key, _TINY_X)["params"]
  assert jax.tree.structure(stacked) == jax.tree.structure(single)
  for leaf, ref in zip(jax.tree.leaves(stacked), jax.tree.leaves(single)):
    assert leaf.shape == (3, *ref.shape)
    for m in range(3):
      np.testing.assert_array_equal(leaf[m], ref)


def test_init_stacked_rejects_no_clients():
  with pytest.raises(ValueError, match="num_clients"):
    models.init_stacked(_TINY, jax.random.key(0), _TINY_X, 0)


@pytest.mark.parametrize("name", sorted(models.FAMILIES))
def test_family_shares_only_output(name):
  family = models.FAMILIES[name](10, representation_dim=64)
  assert len(family) == 4
  params = [_abstract_params(m, (28, 28, 1)) for m in family]
  rest = []
  for p in params:
    classifier = p["classifier"]
    assert _shapes(classifier["output"]) == {"kernel": (64, 10), "bias": (10,)}
    last_hidden = max(k for k in classifier if k.startswith("hidden_"))
    assert _shapes(classifier[last_hidden])["kernel"][1] == 64
    rest.append(str(_shapes({"features": p["features"],
                             **{k: v for k, v in classifier.items() if k != "output"}})))
  assert len(set(rest)) == len(family)


def _output_shapes(model, input_shape):
  """Shapes of (logits, embedding) for a batch of 2, traced without compiling."""
  x = jax.ShapeDtypeStruct((2, *input_shape), jnp.float32)

  def forward(p, x):
    variables = {"params": p}
    return model.apply(variables, x), model.apply(variables, x, method="embed")

  out = jax.eval_shape(forward, _abstract_params(model, input_shape), x)
  return tuple(o.shape for o in out)


@pytest.mark.parametrize("name", sorted(models.FAMILIES))
@pytest.mark.parametrize("size", [8, 32])
def test_family_shapes(name, size):
  for model in models.FAMILIES[name](6, representation_dim=16):
    assert _output_shapes(model, (size, size, 3)) == ((2, 6), (2, 16))


@pytest.mark.parametrize(
    "input_shape, padding, kernel_size",
    [((8, 8, 1), "SAME", 3), ((15, 15, 1), "SAME", 3), ((16, 16, 1), "VALID", 5),
     ((28, 28, 1), "VALID", 5), ((32, 32, 3), "VALID", 5)],
)
def test_get_model_cnn_padding(input_shape, padding, kernel_size):
  model = models.get_model("cnn", 10, input_shape)
  assert isinstance(model, models.CNN)
  assert model.padding == padding
  assert model.kernel_size == kernel_size
  assert _output_shapes(model, input_shape)[0] == (2, 10)


def test_valid_cnn_too_small_has_no_features():
  # Why get_model switches to SAME: VALID on 15x15 leaves a 0x0 feature map.
  assert models.feature_dim(models.CNN(10, padding="VALID"), (15, 15, 1)) == 0


def test_get_model_mlp_and_unknown():
  model = models.get_model("mlp", 4, (28, 28, 1))
  assert isinstance(model, models.MLP) and model.num_classes == 4
  with pytest.raises(ValueError, match="resnet"):
    models.get_model("resnet", 10, (28, 28, 1))


def test_bfloat16_inputs():
  model = models.CNN(10, padding="SAME")
  x = np.random.default_rng(1).uniform(size=(2, 8, 8, 1)).astype(np.float32)
  params = _random_params(model, (8, 8, 1))
  low = _apply(model, params, jnp.asarray(x, jnp.bfloat16))
  assert low.shape == (2, 10)
  np.testing.assert_allclose(low, _apply(model, params, x), rtol=0.05, atol=0.05)
