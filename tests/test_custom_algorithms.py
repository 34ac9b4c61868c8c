"""The custom algorithms of notebooks/my_algorithms.py (FedPer, Ditto), by hand."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pflax import models
from pflax import simulate
from pflax import train

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "notebooks"))
import my_algorithms  # pylint: disable=g-import-not-at-top,wrong-import-position

MODEL = models.MLP(3, hidden=(4, 5))
COUNTS = jnp.array([[1, 2, 0], [0, 0, 4], [3, 3, 3]])
N = np.array([3.0, 4.0, 9.0])


def _params(seed):
  shapes = jax.eval_shape(MODEL.init, jax.random.key(0), jnp.zeros((1, 16)))["params"]
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: jnp.asarray(rng.normal(size=(3, *s.shape)), jnp.float32),
                      shapes)


def test_fedper_averages_the_base_and_keeps_each_head():
  fedper = my_algorithms.fedper(MODEL, optax.sgd(0.1))
  state = fedper.init(_params(0), COUNTS, jax.random.key(0))
  trained = _params(1)
  mask = jnp.array([True, False, True])
  new = fedper.server_update(state, trained, mask, jax.random.key(1))
  base = trained["features"]["dense_0"]["kernel"]
  expected = (N[0] * base[0] + N[2] * base[2]) / (N[0] + N[2])
  for i in range(3):
    np.testing.assert_allclose(new.params["features"]["dense_0"]["kernel"][i], expected,
                               rtol=1e-5)
  np.testing.assert_array_equal(new.params["classifier"]["output"]["kernel"],
                                trained["classifier"]["output"]["kernel"])


def test_ditto_averages_w_keeps_v_and_anchors_v_at_the_global_model():
  ditto = my_algorithms.ditto(MODEL, optax.sgd(0.1), lam=0.5)
  state = ditto.init(_params(0), COUNTS, jax.random.key(0))
  trained = {"w": _params(1), "v": _params(2)}
  new = ditto.server_update(state, trained, jnp.ones(3, bool), jax.random.key(1))
  w = trained["w"]["classifier"]["output"]["bias"]
  np.testing.assert_allclose(new.global_model["classifier"]["output"]["bias"],
                             np.tensordot(N / N.sum(), w, 1), rtol=1e-5)
  np.testing.assert_array_equal(new.personal["classifier"]["output"]["bias"],
                                trained["v"]["classifier"]["output"]["bias"])
  # The loss: CE of w and of v, plus lam/2 ||v - w_global||^2.
  pair = jax.tree.map(lambda x: x[0], trained)
  anchor = jax.tree.map(lambda x: x[0], ditto.client_context(new))
  batch = train.Batch(jnp.ones((2, 16)), jnp.array([0, 1]), jnp.ones(2, bool))
  ce = lambda p: optax.softmax_cross_entropy_with_integer_labels(
      MODEL.apply({"params": p}, batch.x), batch.y).mean()
  prox = sum(jnp.sum((a - b) ** 2) for a, b in zip(jax.tree.leaves(pair["v"]),
                                                    jax.tree.leaves(anchor)))
  np.testing.assert_allclose(ditto.loss(pair, anchor, batch, jax.random.key(2)),
                             ce(pair["w"]) + ce(pair["v"]) + 0.25 * prox, rtol=1e-5)


def test_ditto_lam_is_sweepable_and_range_checked():
  assert simulate.sweepable(my_algorithms.ditto) == ("lr", "lam")
  with pytest.raises(ValueError, match="lam must be a finite number"):
    my_algorithms.ditto(MODEL, optax.sgd(0.1), lam=-1.0)
