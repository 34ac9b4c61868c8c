"""Image views of FedClassAvg and Local training (`augment=`).

The SimCLR views of FedClassAvg's authors (Jang et al., ICPP 2022; their
`supcon_utils.load_dataset`) as pure JAX functions of a key and an NHWC batch,
and the builders' `augment=` keyword: its validation, its defaults (bit-identical
to the code before it), and finite losses under jit and vmap.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pflax import algorithms
from pflax import data
from pflax import models
from pflax import simulate
from pflax import train
from pflax._src.cli import config as cli_config
from pflax._src.core import prng
from pflax._src.core import tree as tree_lib
from pflax._src.data import augment
from pflax._src.methods import algorithm as alg
from pflax._src.training import losses
from pflax._src.training import parts as parts_lib

KEY = prng.key(0)
VIEWS = ("translate", "simclr", "none")
IMAGE = (8, 8, 1)
K = 3
MODEL = models.MLP(K, hidden=(6, 5))


def _images(shape=(6, 12, 12, 1), seed=0, low=0.0, high=1.0):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.uniform(low, high, size=shape), jnp.float32)


# ------------------------------------------------------------ the view functions


@pytest.mark.parametrize("name", VIEWS)
@pytest.mark.parametrize("shape", [(5, 12, 12, 1), (3, 10, 14, 3)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_views_keep_shape_and_dtype(name, shape, dtype):
  x = _images(shape).astype(dtype)
  out = augment.VIEWS[name](KEY, x)
  assert out.shape == x.shape and out.dtype == x.dtype


@pytest.mark.parametrize("name", ["translate", "simclr"])
def test_views_are_deterministic_per_key_and_differ_between_keys(name):
  x = _images()
  view = augment.VIEWS[name]
  np.testing.assert_array_equal(view(prng.key(3), x), view(prng.key(3), x))
  assert not np.allclose(view(prng.key(3), x), view(prng.key(4), x))


@pytest.mark.parametrize("fn", [augment.simclr, augment.random_resized_crop,
                                augment.translate])
def test_views_differ_per_sample(fn):
  """One image repeated: every copy gets its own crop / flip / jitter."""
  x = jnp.broadcast_to(_images((1, 12, 12, 1)), (8, 12, 12, 1))
  out = np.asarray(fn(KEY, x))
  distinct = {out[i].tobytes() for i in range(len(out))}
  assert len(distinct) > 4


def test_full_crop_without_flip_or_jitter_is_the_input():
  """A crop of scale 1 and ratio 1 resized back is exact; p = 0 flips and jitters
  nothing, and a jitter of strength 0 changes nothing."""
  x = _images((4, 12, 12, 3))
  np.testing.assert_array_equal(
      augment.random_resized_crop(KEY, x, scale=(1.0, 1.0), ratio=(1.0, 1.0)), x)
  np.testing.assert_array_equal(augment.horizontal_flip(KEY, x, p=0.0), x)
  np.testing.assert_array_equal(augment.color_jitter(KEY, x, p=0.0), x)
  np.testing.assert_allclose(augment.color_jitter(KEY, x, strength=0.0, p=1.0), x,
                             atol=1e-6)
  np.testing.assert_array_equal(augment.random_grayscale(KEY, x, p=0.0), x)


def test_flip_mirrors_and_grayscale_averages_channels():
  x = _images((2, 4, 6, 3))
  np.testing.assert_array_equal(augment.horizontal_flip(KEY, x, p=1.0), x[:, :, ::-1])
  gray = np.asarray(augment.random_grayscale(KEY, x, p=1.0))
  np.testing.assert_allclose(gray, np.broadcast_to(
      np.asarray(x) @ np.array([0.299, 0.587, 0.114])[:, None], x.shape), rtol=1e-5)
  one = _images((2, 4, 6, 1))       # RandomGrayscale is a no-op on 1 channel
  np.testing.assert_array_equal(augment.random_grayscale(KEY, one, p=1.0), one)


def test_crop_window_is_resized_bilinearly():
  """The top-left 2x2 window of a 4x4 ramp, upsampled 2x: output pixel centres sit
  at input coordinates 0.25, 0.75, 1.25, 1.75 (edges clamped)."""
  img = jnp.arange(16.0).reshape(4, 4, 1)
  out = augment._crop_and_resize(img, jnp.float32(0), jnp.float32(0),
                                 jnp.float32(2), jnp.float32(2))
  np.testing.assert_allclose(out[..., 0], [[0, 0.25, 0.75, 1.25], [1, 1.25, 1.75, 2.25],
                                           [3, 3.25, 3.75, 4.25], [5, 5.25, 5.75, 6.25]])


def test_simclr_values_stay_in_range():
  """Images in [0, 1] stay in [0, 1] (torchvision's clamp); an image with a wider
  range is clipped to its own range, not cut to [0, 1]."""
  for channels in (1, 3):
    out = np.asarray(augment.simclr(KEY, _images((16, 12, 12, channels))))
    assert np.isfinite(out).all() and out.min() >= 0.0 and out.max() <= 1.0
  wide = _images((16, 12, 12, 1), low=-1.0, high=2.0)
  out = np.asarray(augment.simclr(KEY, wide))
  assert out.min() >= float(wide.min()) - 1e-6 and out.max() <= float(wide.max()) + 1e-6
  assert out.min() < 0.0 and out.max() > 1.0


def test_simclr_under_jit_and_vmap():
  x = _images((4, 12, 12, 1))
  eager = augment.simclr(KEY, x)
  np.testing.assert_allclose(jax.jit(augment.simclr)(KEY, x), eager, atol=1e-5)
  keys = jax.random.split(KEY, 3)
  stacked = jnp.stack([x, x + 0.0, x])
  batched = jax.jit(jax.vmap(augment.simclr))(keys, stacked)
  for i in range(3):
    np.testing.assert_allclose(batched[i], augment.simclr(keys[i], stacked[i]),
                               atol=1e-5)


def test_views_reject_non_images():
  with pytest.raises(ValueError, match=r"simclr augments images of shape \(B, H, W, C\)"):
    augment.simclr(KEY, jnp.ones((4, 16)))


@pytest.mark.parametrize("bad", ["crop", "SimCLR", None, 1])
def test_view_fn_rejects_unknown_names(bad):
  with pytest.raises(ValueError, match="augment must be one of 'translate', 'simclr', "
                                       "'none'"):
    augment.view_fn(bad)


# ------------------------------------------------------------ the builders' keyword


def _optimizer():
  return simulate.client_optimizer("adam", 0.01, adam_b1=0.5)


def _params(m=2, seed=0):
  init = lambda k: MODEL.init(k, jnp.zeros((1, *IMAGE)))["params"]
  return jax.vmap(init)(jax.random.split(prng.key(seed), m))


def _batch(seed=1, b=6):
  rng = np.random.default_rng(seed)
  return train.Batch(x=jnp.asarray(rng.uniform(size=(b, *IMAGE)), jnp.float32),
                     y=jnp.asarray(rng.integers(0, K, size=b), jnp.int32),
                     mask=jnp.asarray(np.arange(b) < b - 1))


def _fedclassavg_loss(algorithm, params, batch, key):
  """Client 0's loss at its own parameters, with the averaged head as context."""
  state = algorithm.init(params, jnp.ones((2, K), jnp.int32), KEY)
  head = jax.tree.map(lambda x: x[0], algorithm.client_context(state))
  return algorithm.loss(jax.tree.map(lambda x: x[0], params), head, batch, key)


@pytest.mark.parametrize("bad", ["crop", "None", ""])
def test_builders_reject_unknown_augment(bad):
  with pytest.raises(ValueError, match="fedclassavg's augment must be one of"):
    algorithms.fedclassavg(MODEL, _optimizer(), augment=bad)
  with pytest.raises(ValueError, match="local's augment must be one of"):
    algorithms.local(MODEL, _optimizer(), augment=bad)


def test_fedclassavg_augment_none_needs_supcon_off():
  with pytest.raises(ValueError, match="augment='none' needs supcon=False"):
    algorithms.fedclassavg(MODEL, _optimizer(), augment="none")
  algorithms.fedclassavg(MODEL, _optimizer(), augment="none", supcon=False)


@pytest.mark.parametrize("name", VIEWS)
def test_builders_accept_every_view(name):
  algorithms.local(MODEL, _optimizer(), augment=name)
  algorithms.fedclassavg(MODEL, _optimizer(), augment=name,
                         supcon=name != "none")


@pytest.mark.parametrize("supcon", [True, False])
def test_fedclassavg_default_loss_is_the_translate_path(supcon):
  """The default (and `augment="translate"`) computes exactly the loss of the code
  before `augment=` existed: CE on `translate(k1, x)`, SupCon on it and
  `translate(k2, x)`, `(k1, k2) = split(key)`."""
  params, batch, key = _params(), _batch(), prng.key(5)
  default = algorithms.fedclassavg(MODEL, _optimizer(), rho=0.3,
                                   supcon=supcon, supcon_temperature=2.0)
  explicit = algorithms.fedclassavg(MODEL, _optimizer(), rho=0.3,
                                    supcon=supcon, supcon_temperature=2.0,
                                    augment="translate")
  q = jax.tree.map(lambda x: x[0], params)
  state = default.init(params, jnp.ones((2, K), jnp.int32), KEY)
  head = jax.tree.map(lambda x: x[0], default.client_context(state))
  k1, k2 = jax.random.split(key)
  view1, view2 = data.translate(k1, batch.x), data.translate(k2, batch.x)
  old = (losses.cross_entropy(alg.logits(MODEL, q, view1), batch.y, batch.mask)
         + 0.3 * losses.proximal(tree_lib.selected(q, algorithms.OUTPUT_LAYER), head,
                                 reduce="mean"))
  if supcon:
    rep = lambda x: parts_lib.representation_fn(MODEL, parts_lib.pflax_parts(MODEL))(q, x)
    old = old + losses.supcon(jnp.concatenate([rep(view1), rep(view2)]),
                              jnp.concatenate([batch.y, batch.y]), 2.0, 0.07,
                              mask=jnp.concatenate([batch.mask, batch.mask]))
  got = _fedclassavg_loss(default, params, batch, key)
  assert got == old
  assert _fedclassavg_loss(explicit, params, batch, key) == got


def test_local_default_loss_is_plain_cross_entropy():
  """`augment="none"` (the default) is the plain CE loss object, no key used."""
  params, batch = _params(), _batch()
  q = jax.tree.map(lambda x: x[0], params)
  local = algorithms.local(MODEL, _optimizer())
  plain = alg.cross_entropy_loss(MODEL)(q, None, batch, KEY)
  assert local.loss(q, None, batch, prng.key(1)) == plain
  assert local.loss(q, None, batch, prng.key(2)) == plain


@pytest.mark.parametrize("name", ["translate", "simclr"])
def test_local_augmented_loss_is_ce_on_fedclassavgs_first_view(name):
  """Local with a view trains on the view FedClassAvg's CE sees for the same key."""
  params, batch, key = _params(), _batch(), prng.key(3)
  q = jax.tree.map(lambda x: x[0], params)
  local = algorithms.local(MODEL, _optimizer(), augment=name)
  view = augment.VIEWS[name](jax.random.split(key)[0], batch.x)
  expected = losses.cross_entropy(alg.logits(MODEL, q, view), batch.y, batch.mask)
  np.testing.assert_allclose(local.loss(q, None, batch, key), expected, rtol=1e-6)
  assert local.loss(q, None, batch, key) != local.loss(q, None, batch, prng.key(4))


def test_fedclassavg_none_without_supcon_is_ce_on_the_batch():
  params, batch = _params(), _batch()
  ca = algorithms.fedclassavg(MODEL, _optimizer(), rho=0.0, supcon=False,
                              augment="none")
  q = jax.tree.map(lambda x: x[0], params)
  expected = losses.cross_entropy(alg.logits(MODEL, q, batch.x), batch.y, batch.mask)
  np.testing.assert_allclose(_fedclassavg_loss(ca, params, batch, prng.key(1)),
                             expected, rtol=1e-6)


def test_simclr_losses_are_finite_under_jit_and_vmap():
  """FedClassAvg (with SupCon) and Local on SimCLR views: finite losses and
  gradients, jitted and vmapped over clients, equal to the eager per-client loss."""
  params, batch = _params(m=3), _batch()
  batches = jax.tree.map(lambda x: jnp.stack([x] * 3), batch)
  keys = jax.random.split(prng.key(9), 3)
  ca = algorithms.fedclassavg(MODEL, _optimizer(), rho=0.4, augment="simclr",
                              supcon_temperature=2.0)
  state = ca.init(params, jnp.ones((3, K), jnp.int32), KEY)
  heads = ca.client_context(state)
  local = algorithms.local(MODEL, _optimizer(), augment="simclr")
  for algorithm, context in ((ca, heads), (local, None)):
    fn = jax.jit(jax.vmap(jax.value_and_grad(algorithm.loss),
                          in_axes=(0, None if context is None else 0, 0, 0)))
    value, grad = fn(params, context, batches, keys)
    assert value.shape == (3,) and np.isfinite(value).all()
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grad))
    row = lambda t, i: jax.tree.map(lambda x: x[i], t)
    eager = algorithm.loss(row(params, 1), None if context is None else row(context, 1),
                           batch, keys[1])
    np.testing.assert_allclose(value[1], eager, rtol=1e-4)


def test_augment_reachable_through_config_and_cli_set():
  """`ExperimentConfig.hyperparameters` and `pflax-run --set NAME.augment=...`."""
  config = cli_config.apply_sets(simulate.ExperimentConfig(), ["local", "fedclassavg"],
                                  ["fedclassavg.augment=simclr", "local.augment=simclr"])
  assert config.hyperparameters == {"fedclassavg": {"augment": "simclr"},
                                    "local": {"augment": "simclr"}}
  from pflax._src.simulation import experiment as experiment_lib
  for name in ("local", "fedclassavg"):
    experiment_lib.check_algorithm(name, config)
  bad = cli_config.apply_sets(simulate.ExperimentConfig(), ["fedclassavg"],
                               ["fedclassavg.augment=crop"])
  with pytest.raises(ValueError, match="augment must be one of"):
    experiment_lib.check_algorithm("fedclassavg", bad)


def test_local_trainer_runs_on_simclr_views():
  """One local epoch of `train.make_trainer`-style training through the public
  simulate path is out of CPU budget here; the step function instead: one Adam
  step on SimCLR views changes the parameters and stays finite."""
  params, batch = _params(m=1), _batch()
  q = jax.tree.map(lambda x: x[0], params)
  local = algorithms.local(MODEL, _optimizer(), augment="simclr")
  grads = jax.jit(jax.grad(local.loss))(q, None, batch, prng.key(0))
  opt = local.optimizer
  updates, _ = opt.update(grads, opt.init(q), q)
  new = jax.tree.map(lambda p, u: p + u, q, updates)
  chex.assert_tree_all_finite(new)
  assert any(not np.allclose(a, b) for a, b in
             zip(jax.tree.leaves(new), jax.tree.leaves(q)))


def test_the_crop_draws_its_vertical_and_horizontal_positions_independently():
  """Issue 34: on images whose two channels hold each pixel's row and column, a
  crop's mean row and mean column locate its window: over many crops of one
  size the two positions are uncorrelated (one draw for both gives 1)."""
  rows, cols = jnp.meshgrid(jnp.arange(16.0), jnp.arange(16.0), indexing="ij")
  x = jnp.broadcast_to(jnp.stack([rows, cols], -1), (600, 16, 16, 2))
  out = augment.random_resized_crop(jax.random.key(3), x, scale=(0.25, 0.25),
                                    ratio=(1.0, 1.0))
  top, left = out[..., 0].mean(axis=(1, 2)), out[..., 1].mean(axis=(1, 2))
  assert float(jnp.ptp(top)) > 5 and float(jnp.ptp(left)) > 5   # both move
  assert abs(float(jnp.corrcoef(top, left)[0, 1])) < 0.15
