"""Client-level DP: the clipping bound, the noise, the wrapper's coverage, the accountant."""

import dataclasses
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pflax import algorithms
from pflax import models
from pflax import privacy
from pflax import simulate
from pflax._src.simulation import experiment as experiment_lib
from pflax._src.cli import privacy as cli_privacy

dp_accounting = pytest.importorskip("dp_accounting")


def _updates(m=6, seed=0, scale=3.0):
  rng = np.random.default_rng(seed)
  return {"a": jnp.asarray(scale * rng.normal(size=(m, 4, 3)), jnp.float32),
          "b": {"c": jnp.asarray(scale * rng.normal(size=(m, 5)), jnp.float32)}}


class ClipTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_every_client_within_the_bound(self):
    updates = _updates()
    mask = jnp.array([True, True, False, True, True, True])
    clipped = self.variant(lambda u, m: privacy.clip_deltas(u, 1.5, mask=m))(updates,
                                                                            mask)
    norms = np.asarray(privacy.update_norms(clipped))
    assert np.all(norms <= 1.5 * (1 + 1e-6)), norms
    assert norms[2] == 0.0
    raw = np.asarray(privacy.update_norms(updates))
    expected = np.where(mask, np.minimum(raw, 1.5), 0.0)   # scaled, not cut
    np.testing.assert_allclose(norms, expected, rtol=1e-5)

  def test_a_non_finite_update_counts_as_zero(self):
    updates = _updates()
    updates["a"] = updates["a"].at[1, 0, 0].set(jnp.nan)
    clipped = privacy.clip_deltas(updates, 1.0)
    assert np.all(np.isfinite(privacy.update_norms(clipped)))
    assert float(privacy.update_norms(clipped)[1]) == 0.0

  def test_bad_clip_norm(self):
    with pytest.raises(ValueError, match="clip_norm must be > 0"):
      privacy.clip_deltas(_updates(), 0.0)


def test_the_noise_has_std_z_c():
  zeros = {"w": jnp.zeros((3, 200_000))}
  out = privacy.dp_mean(zeros, jax.random.key(7), 0.5, 2.0, 4.0)["w"]
  # std of the mean: z C / (q M) = 2 * 0.5 / 4; 200k samples: 1% is > 6 sigma.
  np.testing.assert_allclose(float(jnp.std(out)), 0.25, rtol=0.01)
  assert abs(float(jnp.mean(out))) < 0.25 * 6 / math.sqrt(200_000)


def test_dp_mean_without_noise_is_the_sum_over_q_m():
  updates = _updates()
  mask = jnp.array([True, False, True, True, False, True])
  out = privacy.dp_mean(updates, jax.random.key(0), jnp.inf, 0.0, 2.5, mask=mask)
  expected = jax.tree.map(lambda x: np.asarray(x)[np.asarray(mask)].sum(0) / 2.5,
                          updates)
  chex.assert_trees_all_close(out, expected, rtol=1e-6)


def test_poisson_sample_rate():
  drawn = privacy.poisson_sample(jax.random.key(3), 100_000, 0.3)
  assert abs(float(jnp.mean(drawn)) - 0.3) < 0.005


def _models(m=4, seed=0):
  model = models.MLP(3, hidden=(5,))
  keys = jax.random.split(jax.random.key(seed), m)
  params = jax.vmap(lambda k: model.init(k, jnp.zeros((1, 4)))["params"])(keys)
  first = jax.tree.map(lambda x: jnp.broadcast_to(x[0], x.shape), params)
  return model, first, params


def _state_and_trained(algorithm, m=4):
  _, first, moved = _models(m)
  counts = jnp.full((m, 3), 5)
  state = algorithm.init(first, counts, jax.random.key(0))
  start = algorithm.client_models(state)
  trained = jax.tree.map(lambda s, d: s + 0.1 * d, start,
                         jax.tree.map(lambda x: x, _like(start, moved)))
  return state, trained


def _like(start, moved):
  """A perturbation of `start`'s structure (per model of a dict of models)."""
  if isinstance(start, dict) and set(start) <= {"w", "v", "alpha"}:
    return {k: (moved if k in ("w", "v") else jnp.zeros_like(start[k])) for k in start}
  return moved


SLOW = pytest.mark.slow
COVERED = ("fedavg", "fedper", "ditto", pytest.param("fedprox", marks=SLOW),
           pytest.param("fedrep", marks=SLOW), pytest.param("apfl", marks=SLOW),
           pytest.param("fedbabu", marks=SLOW))


@pytest.mark.parametrize("name", COVERED)
def test_without_noise_or_clipping_it_is_the_methods_own_step(name):
  """z = 0, C = inf, q = 1 (q M = M), equal sample counts: the method's own server
  step, to float32 tolerance (the mean is formed as sum / M before the method
  averages M equal values)."""
  model = models.MLP(3, hidden=(5,))
  plain = algorithms.METHODS[name].builder(model, optax.sgd(0.1))
  dp = privacy.private(plain, jnp.inf, 0.0, 4.0, name)
  state, trained = _state_and_trained(plain)
  mask = jnp.ones(4, bool)
  key = jax.random.key(1)
  chex.assert_trees_all_close(jax.jit(dp.server_update)(state, trained, mask, key),
                              plain.server_update(state, trained, mask, key),
                              rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ("fedper", "ditto", pytest.param("apfl", marks=SLOW),
                                  pytest.param("fedrep", marks=SLOW)))
def test_personal_parts_are_never_noised_or_read(name):
  """The personal leaves of the models clients train from next round (FedPer's
  head, Ditto's and APFL's v) equal the method's own; the released value does
  not depend on them."""
  model = models.MLP(3, hidden=(5,))
  plain = algorithms.METHODS[name].builder(model, optax.sgd(0.1))
  dp = privacy.private(plain, 0.01, 50.0, 2.0, name)
  state, trained = _state_and_trained(plain)
  mask = jnp.array([True, False, True, True])
  key = jax.random.key(2)
  flags = plain.uploads(trained)
  assert any(flags) and not all(flags)
  ours = dp.client_models(dp.server_update(state, trained, mask, key))
  theirs = plain.client_models(plain.server_update(state, trained, mask, key))
  leaves = lambda t: jax.tree.leaves(t)
  for shared, a, b in zip(flags, leaves(ours), leaves(theirs)):
    if not shared:
      np.testing.assert_array_equal(a, b)
  # The mechanism reads only the uploads: other personal values, same result.
  personal_changed = jax.tree.unflatten(jax.tree.structure(trained), [
      x if f else x + 100.0 for f, x in zip(flags, leaves(trained))])
  again = dp.client_models(dp.server_update(state, personal_changed, mask, key))
  for shared, a, b in zip(flags, leaves(ours), leaves(again)):
    if shared:
      np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", sorted(privacy.REFUSED))
def test_refused_methods_name_what_is_not_covered(name):
  config = simulate.ExperimentConfig(dp_clip=1.0, dp_noise_multiplier=1.0)
  with pytest.raises(ValueError, match=f"does not cover {name}: "):
    experiment_lib.check_algorithm(name, config)


@SLOW
def test_fedbabu_fine_tuned_models_are_its_own():
  plain = algorithms.fedbabu(models.MLP(3, hidden=(5,)), optax.sgd(0.1))
  dp = privacy.private(plain, 0.01, 50.0, 2.0, "fedbabu")
  state, trained = _state_and_trained(plain)
  mask = jnp.array([True, False, True, True])
  key = jax.random.key(2)
  chex.assert_trees_all_equal(dp.server_update(state, trained, mask, key).tuned,
                              plain.server_update(state, trained, mask, key).tuned)


def test_robust_aggregators_are_refused():
  plain = algorithms.fedavg(models.MLP(3), optax.sgd(0.1), robust="median")
  with pytest.raises(ValueError, match="declares no uploads"):
    privacy.private(plain, 1.0, 1.0, 1.0)


def test_epsilon_matches_dp_accounting():
  q, z, rounds, delta = 0.01, 1.1, 1000, 1e-5
  accountant = dp_accounting.rdp.RdpAccountant()
  accountant.compose(dp_accounting.PoissonSampledDpEvent(
      q, dp_accounting.GaussianDpEvent(z)), rounds)
  assert privacy.epsilon(q, z, rounds, delta) == pytest.approx(
      accountant.get_epsilon(delta), rel=1e-9)
  spent = privacy.epsilons(q, z, 5, delta)
  assert spent == sorted(spent) and spent[-1] == pytest.approx(
      privacy.epsilon(q, z, 5, delta), rel=1e-9)


@pytest.mark.parametrize("target,rate,rounds", [(4.0, 0.5, 20), (1.0, 0.1, 50)])
def test_calibrated_z_reaches_the_target(target, rate, rounds):
  z = privacy.noise_multiplier_for(target, 1e-5, rate, rounds)
  assert privacy.epsilon(rate, z, rounds, 1e-5) == pytest.approx(target, rel=0.01)
  assert privacy.epsilon(rate, z, rounds, 1e-5) <= target


def test_the_run_stops_at_the_budget():
  config = simulate.ExperimentConfig(participation=0.5, rounds=10, dp_clip=1.0,
                                     dp_noise_multiplier=1.0, dp_epsilon=6.0)
  cut = cli_privacy.planned(config)
  spent = privacy.epsilons(0.5, 1.0, 10, 1e-5)
  assert cut.rounds == 2 and spent[1] <= 6.0 < spent[2]
  with pytest.raises(SystemExit, match="already spends eps = 3.89.*nothing run"):
    cli_privacy.planned(dataclasses.replace(config, dp_epsilon=1.0))
  calibrated = cli_privacy.planned(dataclasses.replace(config, dp_noise_multiplier=None))
  assert calibrated.rounds == 10
  assert privacy.epsilon(0.5, calibrated.dp_noise_multiplier, 10, 1e-5) == (
      pytest.approx(6.0, rel=0.01))
