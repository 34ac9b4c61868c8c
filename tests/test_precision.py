"""The bfloat16 compute mode: float32 parameters, bf16 activations, refused values."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pflax import losses
from pflax import simulate
from pflax import train
from pflax._src.cli import main as cli

M, L, D, K, B = 3, 12, 6, 4, 4


def _problem():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(M, L, D)), jnp.float32)
  y = jnp.asarray(rng.integers(0, K, size=(M, L)), jnp.int32)
  valid = jnp.arange(L)[None, :] < jnp.array([12, 7, 3])[:, None]
  params = {"w": jnp.asarray(rng.normal(size=(M, D, K)), jnp.float32),
            "b": jnp.zeros((M, K))}
  return params, x, y, valid, jax.random.split(jax.random.PRNGKey(0), M)


def test_float32_is_the_loss_itself():
  loss_fn = lambda params, context, batch, key: 0.0
  assert train.with_precision(loss_fn, "float32") is loss_fn


@pytest.mark.parametrize("strategy", ["loop"])
def test_bf16_computes_in_bf16_and_keeps_float32_state(strategy):
  seen = []

  def loss_fn(params, context, batch, key):
    del context, key
    seen.append((params["w"].dtype, batch.x.dtype))
    logits = batch.x @ params["w"] + params["b"]
    return losses.cross_entropy(logits, batch.y, batch.mask)

  params, x, y, valid, keys = _problem()
  optimizer = optax.adam(0.05)
  opt_state = train.init_opt_state(optimizer, params)
  out = {p: train.make_trainer(loss_fn, optimizer, epochs=2, batch_size=B,
                               strategy=strategy, precision=p)(
                                   params, opt_state, None, x, y, valid, keys)
         for p in train.PRECISIONS}
  assert (jnp.bfloat16, jnp.bfloat16) in seen and (jnp.float32, jnp.float32) in seen
  for leaf in jax.tree.leaves(out["bf16"]):
    assert leaf.dtype in (jnp.float32, jnp.int32), leaf.dtype  # (adam's count: int32)
  for low, full in zip(jax.tree.leaves(out["bf16"].params),
                       jax.tree.leaves(out["float32"].params)):
    np.testing.assert_allclose(low, full, atol=0.05)  # bf16: ~3 significant digits
  assert not all(np.array_equal(a, b) for a, b in zip(
      jax.tree.leaves(out["bf16"].params), jax.tree.leaves(out["float32"].params)))
  np.testing.assert_allclose(out["bf16"].loss, out["float32"].loss, rtol=0.02)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["local", "fedavg"])
def test_bf16_run_is_as_accurate_as_float32(name):
  # Digits, 6 clients, 4 rounds: float32 reached 0.955 (local) and 0.450
  # (fedavg's global model on 2 classes per client), bf16 the same to 0.01.
  config = simulate.ExperimentConfig(clients=6, rounds=4, model="mlp", local_epochs=1)
  setup = simulate.prepare(config, seed=0)
  runs = {p: simulate.run(name, dataclasses.replace(config, precision=p), 0,
                          setup=setup) for p in train.PRECISIONS}
  full, low = (runs[p].summary() for p in train.PRECISIONS)
  assert full.final > (0.9 if name == "local" else 0.4)
  assert abs(low.final - full.final) < 0.03 and abs(low.best - full.best) < 0.03


def test_bad_precision_is_refused(tmp_path):
  with pytest.raises(ValueError, match=r"precision must be one of \('float32', 'bf16'\)"):
    train.make_trainer(lambda *a: 0.0, optax.sgd(0.1), epochs=1, batch_size=2,
                       precision="float16")
  with pytest.raises(ValueError, match="precision must be one of"):
    simulate.ExperimentConfig(precision="bfloat16")
  with pytest.raises(SystemExit):
    cli.main(["--precision", "fp16", "--out", str(tmp_path)])
  with pytest.raises(SystemExit, match="--precision bf16 is for simulations"):
    cli.main(["--flower", "--precision", "bf16", "--out", str(tmp_path)])
