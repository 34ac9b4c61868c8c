"""Client-level DP: the clipping bound, the noise, the wrapper's coverage, the accountant."""

import dataclasses
import math

import chex
import hypothesis
import hypothesis.strategies as st
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


# ------------------------------------------- the seed methods' own DP steps


def _class_case(m=4, k=3, seed=0, scale=3.0, model_scale=1.0):
  """Trained class-wise layers, class models (`model_scale` times smaller),
  class distributions, rest updates."""
  rng = np.random.default_rng(seed)
  f32 = lambda *shape, s=scale: jnp.asarray(s * rng.normal(size=shape), jnp.float32)
  layers = {"kernel": f32(m, 5, k), "bias": f32(m, k)}
  s = scale * model_scale
  class_models = {"kernel": f32(k, 5, k, s=s), "bias": f32(k, k, s=s)}
  dist = jnp.asarray(rng.dirichlet(np.ones(k), size=m), jnp.float32)
  rest = {"hidden": f32(m, 4, 5)}
  return layers, class_models, dist, rest


def _reference_vectors(layers, class_models, dist, rest):
  """NumPy: each client's vector (a_ij (w_i - G_j) for all j, r_i), flattened."""
  a = np.asarray(dist, np.float64)
  a = a / a.sum(1, keepdims=True)
  parts = []
  for name in ("bias", "kernel"):
    w, g = np.asarray(layers[name], np.float64), np.asarray(class_models[name], np.float64)
    parts.append((a.reshape(a.shape + (1,) * (w.ndim - 1))
                  * (w[:, None] - g[None])).reshape(len(a), -1))
  parts.append(np.asarray(rest["hidden"], np.float64).reshape(len(a), -1))
  return np.concatenate(parts, axis=1)


def _released_vector(new, class_models, rest_update, qm, k):
  """What the mechanism released, back on the scale of the summed vectors."""
  parts = [(np.asarray(new[name], np.float64) - np.asarray(class_models[name], np.float64)
            ).reshape(-1) * qm / k for name in ("bias", "kernel")]
  parts.append(np.asarray(rest_update["hidden"], np.float64).reshape(-1) * qm)
  return np.concatenate(parts)


@hypothesis.given(seed=st.integers(0, 2**31 - 1),
                  scale=st.sampled_from([0.01, 1.0, 30.0]),
                  clip=st.sampled_from([0.1, 1.0, 10.0]))
def test_dp_class_models_clips_each_clients_vector_jointly(seed, scale, clip):
  """One participant, no noise: the release is its clipped vector (all K class
  contributions and its rest update as one), of norm <= C, equal to the
  NumPy reference's `v_i min(1, C / ||v_i||)` (class models 10x smaller than
  the layers, so that `G' - G` in float32 keeps the released digits)."""
  layers, class_models, dist, rest = _class_case(seed=seed % 1000, scale=scale,
                                                 model_scale=0.1)
  vectors = _reference_vectors(layers, class_models, dist, rest)
  qm, k = 2.0, 3
  for i in range(4):
    mask = jnp.arange(4) == i
    new, rest_update = privacy.dp_class_models(
        layers, class_models, dist, jax.random.key(0), clip, 0.0, qm, rest=rest,
        mask=mask)
    released = _released_vector(new, class_models, rest_update, qm, k)
    assert np.linalg.norm(released) <= clip * (1 + 1e-5)
    norm = np.linalg.norm(vectors[i])
    np.testing.assert_allclose(released, vectors[i] * min(1.0, clip / norm),
                               rtol=1e-4, atol=1e-5 * clip)


def test_dp_class_models_sums_the_weighted_contributions_over_fixed_denominators():
  """z = 0, C = inf, partial mask: G_j + sum_i a_ij (w_i - G_j) / (qM / K) and
  sum_i r_i / (qM), by NumPy."""
  layers, class_models, dist, rest = _class_case(m=5, seed=3)
  mask = jnp.array([True, False, True, True, False])
  new, rest_update = privacy.dp_class_models(
      layers, class_models, dist, jax.random.key(0), jnp.inf, 0.0, 2.5, rest=rest,
      mask=mask)
  a = np.asarray(dist) / np.asarray(dist).sum(1, keepdims=True) * np.asarray(mask)[:, None]
  for name in ("kernel", "bias"):
    w, g = np.asarray(layers[name]), np.asarray(class_models[name])
    step = np.einsum("ij,ij...->j...", a, w[:, None] - g[None]) / (2.5 / 3)
    np.testing.assert_allclose(new[name], g + step, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(rest_update["hidden"],
                             np.asarray(rest["hidden"])[np.asarray(mask)].sum(0) / 2.5,
                             rtol=1e-5, atol=1e-6)


def test_a_client_weights_only_the_classes_it_holds():
  """`class_dist` enters only as the weights a_ij: a participant whose
  distribution is one class leaves every other class model unchanged."""
  layers, class_models, _, rest = _class_case()
  dist = jnp.array([[0.0, 2.0, 0.0]] * 4)
  new, _ = privacy.dp_class_models(layers, class_models, dist, jax.random.key(0),
                                   jnp.inf, 0.0, 1.0, rest=rest,
                                   mask=jnp.array([True, False, False, False]))
  for name in ("kernel", "bias"):
    np.testing.assert_array_equal(new[name][jnp.array([0, 2])],
                                  class_models[name][jnp.array([0, 2])])
    np.testing.assert_allclose(new[name][1], class_models[name][1] + 3 * (
        layers[name][0] - class_models[name][1]), rtol=1e-5, atol=1e-5)


def test_dp_class_models_noise_has_std_z_c_over_each_denominator():
  """Zero contributions: the class models move by N(0, (z C K / qM)^2), the
  rest by N(0, (z C / qM)^2)."""
  k, qm, z, c = 4, 8.0, 2.0, 0.5
  models_ = {"w": jnp.ones((k, 50_000))}
  layers = {"w": jnp.ones((3, 50_000))}
  dist = jnp.full((3, k), 1.0)
  # The clients' layers equal every class model: all contributions are 0.
  new, rest_update = privacy.dp_class_models(
      layers, models_, dist, jax.random.key(11), c, z, qm,
      rest={"r": jnp.zeros((3, 200_000))})
  moved = np.asarray(new["w"]) - 1.0     # 200k draws: 1% is > 6 sigma
  np.testing.assert_allclose(moved.std(), z * c * k / qm, rtol=0.01)
  np.testing.assert_allclose(float(jnp.std(rest_update["r"])), z * c / qm, rtol=0.01)
  assert abs(moved.mean()) < z * c * k / qm * 6 / math.sqrt(moved.size)


def _counts_with_uniform_mean(m=3):
  """Equal sample counts (4 each) whose class distributions average to uniform
  (each column of p sums to M / K = 1): Eq. 6 with equal n_i is then DP's
  sum over q M / K with z = 0, C = inf."""
  return jnp.array([[2, 1, 1], [1, 2, 1], [1, 1, 2]])[:m]


def _seed_state_and_trained(algorithm, counts):
  m = counts.shape[0]
  _, first, moved = _models(m)
  state = algorithm.init(first, counts, jax.random.key(0))
  start = algorithm.client_models(state)
  return state, jax.tree.map(lambda s, d: s + 0.1 * d, start, moved)


class SeedMethodsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_cwfedavg_without_noise_or_clipping_is_eq_6(self):
    """z = 0, C = inf, full participation, equal counts, p averaging to 1/K:
    the class models, the rest and every client's next model equal the
    ordinary server step's (output layer class-wise, and every layer), in a
    second round too, from class models that differ."""
    for layers in ("output", "all"):
      plain = algorithms.cwfedavg(models.MLP(3, hidden=(5,)), optax.sgd(0.1),
                                  layers=layers, class_dist="empirical")
      dp = privacy.private(plain, jnp.inf, 0.0, 3.0, "cwfedavg")
      state, trained = _seed_state_and_trained(plain, _counts_with_uniform_mean())
      mask, key = jnp.ones(3, bool), jax.random.key(1)
      state = plain.server_update(state, trained, mask, key)
      trained = jax.tree.map(lambda s, d: s - 0.2 * d, plain.client_models(state),
                             _models(3, seed=5)[2])
      ours = self.variant(dp.server_update)(state, trained, mask, key)
      theirs = plain.server_update(state, trained, mask, key)
      chex.assert_trees_all_close((ours.class_models, ours.rest, ours.class_dist),
                                  (theirs.class_models, theirs.rest, theirs.class_dist),
                                  rtol=1e-5, atol=1e-6)
      chex.assert_trees_all_close(dp.client_models(ours), plain.client_models(theirs),
                                  rtol=1e-5, atol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_fedclassavg_without_noise_or_clipping_is_eq_3(self):
    plain = algorithms.fedclassavg(models.MLP(3, hidden=(5,)), optax.sgd(0.1))
    dp = privacy.private(plain, jnp.inf, 0.0, 3.0, "fedclassavg")
    state, trained = _seed_state_and_trained(plain, _counts_with_uniform_mean())
    mask, key = jnp.ones(3, bool), jax.random.key(1)
    chex.assert_trees_all_close(
        self.variant(dp.server_update)(state, trained, mask, key),
        plain.server_update(state, trained, mask, key), rtol=1e-5, atol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_fedclassavg_keeps_each_clients_own_model_and_clips_its_head(self):
    """Participants keep their trained model (classifier too), others their
    old one; the head moves by the clipped update of its one participant,
    which reads no leaf but the classifier."""
    plain = algorithms.fedclassavg(models.MLP(3, hidden=(5,)), optax.sgd(0.1))
    dp = privacy.private(plain, 0.05, 0.0, 2.0, "fedclassavg")
    counts = jnp.full((4, 3), 5)
    state, trained = _seed_state_and_trained(plain, counts)
    trained = jax.tree.map(lambda x: 10.0 * x, trained)
    step = self.variant(dp.server_update)
    key = jax.random.key(2)
    for i in range(4):
      mask = jnp.arange(4) == i
      new = step(state, trained, mask, key)
      chex.assert_trees_all_equal(new.params, jax.tree.map(
          lambda t, o: jnp.where(mask.reshape((-1,) + (1,) * (t.ndim - 1)), t, o),
          trained, state.params))
      moved = jax.tree.map(lambda a, b: 2.0 * (a - b), new.head, state.head)
      assert float(privacy.update_norms(jax.tree.map(lambda x: x[None], moved))[0]) <= (
          0.05 * (1 + 1e-5))
      body_changed = jax.tree_util.tree_map_with_path(
          lambda p, x: x if "output" in jax.tree_util.keystr(p) else x + 1.0, trained)
      chex.assert_trees_all_equal(step(state, body_changed, mask, key).head, new.head)

  def test_cwfedavg_class_dist_is_the_clients_own_and_no_upload_is_kept(self):
    """The state's class distributions are the participants' own estimates
    (Eq. 4, as the ordinary step's), never noised; the stored uploads are not
    written; the released class models move with the noise."""
    plain = algorithms.cwfedavg(models.MLP(3, hidden=(5,)), optax.sgd(0.1))
    dp = privacy.private(plain, 1.0, 1.0, 2.0, "cwfedavg")
    state, trained = _seed_state_and_trained(plain, jnp.full((4, 3), 5))
    mask, key = jnp.array([True, False, True, True]), jax.random.key(3)
    ours = jax.jit(dp.server_update)(state, trained, mask, key)
    theirs = plain.server_update(state, trained, mask, key)
    chex.assert_trees_all_equal(ours.class_dist, theirs.class_dist)
    chex.assert_trees_all_equal((ours.uploads, ours.uploaded),
                                (state.uploads, state.uploaded))
    other = jax.jit(dp.server_update)(state, trained, mask, jax.random.key(4))
    assert not np.allclose(jax.tree.leaves(ours.class_models)[0],
                           jax.tree.leaves(other.class_models)[0])


@pytest.mark.parametrize("name", ["cwfedavg", "fedclassavg"])
def test_seed_methods_are_covered(name):
  plain = algorithms.METHODS[name].builder(models.MLP(3), optax.sgd(0.1))
  assert privacy.not_covered(plain, name) is None
  config = simulate.ExperimentConfig(dp_clip=1.0, dp_noise_multiplier=1.0)
  experiment_lib.check_algorithm(name, config)


def test_fedclassavg_with_a_robust_rule_or_heterogeneous_models_is_refused():
  robust = algorithms.fedclassavg(models.MLP(3), optax.sgd(0.1), robust="median")
  assert "robust aggregator" in privacy.not_covered(robust, "fedclassavg")
  family = (models.MLP(3, hidden=(4, 5)), models.MLP(3, hidden=(6, 5)))
  het = algorithms.heterogeneous(lambda m: algorithms.fedclassavg(m, optax.sgd(0.1)),
                                 family)
  assert "heterogeneous" in privacy.not_covered(het, "fedclassavg")
  with pytest.raises(ValueError, match="does not cover fedclassavg"):
    privacy.private(het, 1.0, 1.0, 1.0, "fedclassavg")
  config = simulate.ExperimentConfig(dp_clip=1.0, dp_noise_multiplier=1.0,
                                     hyperparameters={"fedclassavg": {"robust": "median"}})
  with pytest.raises(ValueError, match="does not cover fedclassavg"):
    experiment_lib.check_algorithm("fedclassavg", config)


def test_only_a_local_warmup_is_allowed():
  """FedClassAvg's warm-up only keeps each client's model (local); a warm-up
  that is not declared local is refused."""
  plain = algorithms.fedclassavg(models.MLP(3), optax.sgd(0.1), warmup_epochs=1)
  assert plain.warmup.local and privacy.not_covered(plain) is None
  uploading = plain._replace(warmup=plain.warmup._replace(local=False))
  assert "warm-up" in privacy.not_covered(uploading)
