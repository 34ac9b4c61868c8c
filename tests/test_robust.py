"""Absurd uploads and lies (issue 22, item 4): the outlier rule, the robust
options of global-model methods, and the fault kinds that measure them.

Each aggregator of pflax._src.aggregators.robust is compared to its float64 reference in
tests/references.py; the conformance harness runs `median`, `trimmed_mean` and
FedAvg with capped weights too.
"""

import dataclasses

import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pflax import aggregate as agg
from pflax import algorithms
from pflax import models
from pflax import simulate
from pflax._src.simulation import engine
from pflax._src.simulation import faults as faults_lib
from pflax._src.simulation import groups
from pflax._src.simulation import protocol

import references as ref

MASKS = [None, np.array([True, False, True, True, False, True, True])]


def _params(seed, m=7):
  return ref.random_params(np.random.default_rng(seed), m)


# ----------------------------------------------------------- references


@pytest.mark.parametrize("mask", MASKS)
def test_median_matches_reference(mask):
  for seed, m in [(0, 7), (1, 6)]:
    params = _params(seed, m)
    mask_ = None if mask is None else mask[:m]
    ref.assert_tree_close(agg.median(params, mask=mask_), ref.median_ref(params, mask_))


def test_median_ties_and_masked_nonfinite():
  w = np.array([[1.0, 2.0], [1.0, np.nan], [3.0, 2.0], [5.0, 2.0]], np.float32)
  out = agg.median({"w": w}, mask=np.array([True, False, True, True]))
  np.testing.assert_array_equal(out["w"], [3.0, 2.0])


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("beta", [0.0, 0.2, 0.34])
def test_trimmed_mean_matches_reference(mask, beta):
  params = _params(2)
  ref.assert_tree_close(agg.trimmed_mean(params, trim_fraction=beta, mask=mask),
                        ref.trimmed_mean_ref(params, beta, mask))


def test_trimmed_mean_zero_is_the_mean():
  params = _params(3)
  ref.assert_tree_close(agg.trimmed_mean(params, trim_fraction=0.0),
                        ref.fedavg_ref(params))


@pytest.mark.parametrize("cap", [0.05, 0.2, 0.3, 1.0])
@pytest.mark.parametrize("mask", MASKS)
def test_capped_weights_match_reference(cap, mask):
  rng = np.random.default_rng(4)
  n = rng.integers(1, 20, 7).astype(np.float32)
  n[2] = 500.0                               # one liar
  n[5] = 0.0                                 # a client without samples
  p = np.asarray(agg.capped_weights(n, cap, mask=mask))
  np.testing.assert_allclose(p, ref.capped_weights_ref(n, cap, mask), atol=1e-6)
  np.testing.assert_allclose(p.sum(), 1.0, rtol=1e-6)
  active = (n > 0) & (True if mask is None else mask)
  assert p.max() <= max(cap, 1 / active.sum()) + 1e-6
  assert np.all(p[~active] == 0)
  order = np.argsort(n[active], kind="stable")
  assert np.all(np.diff(p[active][order]) >= -1e-7)   # the order of counts kept


def test_capped_weights_never_change_fair_weights():
  n = np.array([3.0, 1.0, 2.0, 2.0])
  np.testing.assert_allclose(agg.capped_weights(n, 0.5), n / n.sum(), rtol=1e-6)


@pytest.mark.parametrize("mask", MASKS)
def test_clip_updates_match_reference(mask):
  params = _params(5)
  reference = jax.tree.map(lambda x: x[0] * 0.5, params)
  out = agg.clip_updates(params, reference, 1.5, mask=mask)
  expected = ref.clip_updates_ref(params, reference, 1.5)
  if mask is not None:
    expected = jax.tree.map(lambda e, x: np.where(
        mask.reshape((-1,) + (1,) * (x.ndim - 1)), e, x), expected, params)
  ref.assert_tree_close(out, expected, rtol=1e-5, atol=1e-5)
  norms = ref.update_norms_ref(out, reference)
  assert np.all(norms[mask if mask is not None else slice(None)] <= 1.5 * (1 + 1e-5))


def test_update_norms_of_huge_models_stay_finite():
  params = _params(6)
  params = jax.tree.map(lambda x: x.copy(), params)
  for leaf in jax.tree.leaves(params):
    leaf[1] *= np.float32(1e30)              # norms near float32's maximum
  reference = jax.tree.map(lambda x: x[0], params)
  log2 = np.asarray(agg.log2_update_norms(params, reference))
  expected = ref.update_norms_ref(params, reference)
  assert np.isneginf(log2[0])                # client 0 is the reference
  np.testing.assert_allclose(np.exp2(log2[1:].astype(np.float64)), expected[1:],
                             rtol=1e-4)


# --------------------------------------------------------------- the rule


def test_outlier_rule():
  norms = np.log2(np.array([1.0, 2.0, 3.0, 5e3, 4.0, 1.0, 1e9], np.float32))
  norms[5] = -np.inf                           # an update of 0
  took = np.array([True, True, True, True, True, True, False])
  out = np.asarray(faults_lib.update_outliers(jnp.asarray(norms), jnp.asarray(took), 1000.0))
  # median of the non-zero participants' norms {1, 2, 3, 4, 5e3} is 3: 5e3 > 3e3.
  np.testing.assert_array_equal(out, [False, False, False, True, False, False, False])
  assert not np.asarray(faults_lib.update_outliers(jnp.asarray(norms), jnp.asarray(took),
                                               None)).any()
  two = np.array([True, False, False, True, False, False, False])
  assert not np.asarray(faults_lib.update_outliers(jnp.asarray(norms), jnp.asarray(two),
                                               1000.0)).any()   # nobody to outvote


def test_federation_drops_an_absurd_upload_like_the_engine():
  """`protocol.server_step` applies `faults.healthy_clients`: a 1e30 update is
  dropped from the round, the others are averaged."""
  model = models.MLP(3)
  m = 4
  fedavg = groups.as_groups(algorithms.fedavg(model, optax.sgd(0.1)), model, m)
  state = algorithms.GlobalModel({"w": jnp.zeros(2)}, jnp.ones(m))
  tasks = protocol.Tasks(clients=np.arange(m), starts=({"w": jnp.zeros((m, 2))},),
                         contexts=(None,), keys=None, server_key=jax.random.key(0))
  uploads = {i: {"w": np.full(2, 1.0 + i, np.float32)} for i in range(m)}
  uploads[2] = {"w": np.full(2, 1e30, np.float32)}
  new, healthy = protocol.server_step(fedavg, state, tasks, uploads)
  np.testing.assert_array_equal(healthy, [True, True, False, True])
  np.testing.assert_allclose(new.model["w"], [(1 + 2 + 4) / 3] * 2, rtol=1e-6)
  new, healthy = protocol.server_step(fedavg, state, tasks, uploads,
                                      outlier_factor=None)
  assert healthy.all() and new.model["w"][0] > 1e29


# --------------------------------------------------------- the builders


def test_builder_options_reach_the_server_step():
  m = 5
  trained = {"w": jnp.array([[1.0], [2.0], [3.0], [4.0], [1e6]])}
  state = algorithms.GlobalModel({"w": jnp.zeros(1)},
                                 jnp.array([1.0, 1.0, 1.0, 1.0, 96.0]))
  mask = jnp.ones(m, bool)
  run = lambda **kw: algorithms.fedavg(
      models.MLP(3), optax.sgd(0.1), **kw).server_update(
          state, trained, mask, None).model["w"][0]
  assert run() == pytest.approx((10 + 96e6) / 100)
  assert run(robust="median") == 3.0
  assert run(robust="trimmed_mean", trim_fraction=0.2) == 3.0
  assert run(max_share=0.2) == pytest.approx((10 + 1e6) / 5)
  assert run(clip_norm=2.0) == pytest.approx((1 + 2 + 2 + 2 + 96 * 2) / 100)
  prox = algorithms.fedprox(models.MLP(3), optax.sgd(0.1), robust="median")
  assert prox.server_update(state, trained, mask, None).model["w"][0] == 3.0
  with pytest.raises(ValueError, match="robust"):
    algorithms.fedavg(models.MLP(3), optax.sgd(0.1), robust="mean")
  with pytest.raises(ValueError, match="max_share"):
    algorithms.fedavg(models.MLP(3), optax.sgd(0.1), robust="median",
                      max_share=0.2)


# ----------------------------------------------------- fault kinds, end to end


CONFIG = simulate.ExperimentConfig(clients=6, rounds=2, model="mlp", local_epochs=1,
                                   faulty_clients=0.2)


@pytest.fixture(scope="module")
def setup():
  return simulate.prepare(CONFIG, seed=0)


def test_scaled_updates_are_dropped_and_only_they(setup):
  run = simulate.run("fedavg", dataclasses.replace(CONFIG, fault_kind="scaled"), 0,
                     setup=setup)
  for r in run.history:
    assert r.faulty_clients and r.dropped_clients == r.faulty_clients
  assert run.summary("global").final > 0.3      # 10% (chance) once poisoned


def test_inflated_counts_are_the_same_liars_all_run(setup):
  config = dataclasses.replace(CONFIG, fault_kind="inflated_counts")
  run = simulate.run("fedavg", config, 0, setup=setup)
  liars = np.flatnonzero(faults_lib.lying_clients(jnp.int32(0), 6, 6, 0.2))
  assert [r.faulty_clients for r in run.history] == [tuple(liars)] * 2
  assert all(not r.dropped_clients for r in run.history)


def test_fault_fields_are_checked():
  for field, value in [("fault_kind", "flip"), ("outlier_factor", 0.5),
                       ("fault_scale", float("inf"))]:
    with pytest.raises(ValueError, match=field):
      dataclasses.replace(CONFIG, **{field: value})


def test_set_reaches_the_robust_keywords():
  from pflax._src.cli import config as cli_config  # pylint: disable=import-outside-toplevel
  config = cli_config.apply_sets(simulate.ExperimentConfig(), ["fedavg", "fedprox"],
                                  ["max_share=0.2", "fedavg.robust=median"])
  assert config.hyperparameters == {"fedavg": {"max_share": 0.2, "robust": "median"},
                                    "fedprox": {"max_share": 0.2}}


def test_declared_counts_inflate_the_liars_rows_only():
  plan = engine.Plan(build=None, num_clients=6, participation=1.0, fault_fraction=0.2,
                     local_epochs=1, batch_size=1, strategy="vmap",
                     fault_kind="inflated_counts")
  counts = jnp.arange(1, 8 * 3 + 1, dtype=jnp.int32).reshape(8, 3)   # 2 padded rows
  out = np.asarray(engine.declared_counts(plan, counts, jnp.int32(0)))
  liars = np.asarray(faults_lib.lying_clients(jnp.int32(0), 6, 8, 0.2))
  assert liars.sum() == 1 and not liars[6:].any()
  np.testing.assert_array_equal(out[liars], np.asarray(counts)[liars] * 10)
  np.testing.assert_array_equal(out[~liars], np.asarray(counts)[~liars])
  same = dataclasses.replace(plan, fault_kind="nan")
  assert engine.declared_counts(same, counts, jnp.int32(0)) is counts


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(
    counts=hnp.arrays(np.float32, 6, elements=st.sampled_from(
        [0.0, 1.0, 2.0, 7.0, 1e3, 3e38])),
    cap=st.sampled_from([0.1, 0.2, 0.25, 0.5, 1.0]),
    mask=hnp.arrays(np.bool_, 6))
def test_capped_weights_properties(counts, cap, mask):
  """Against the bisection reference, for counts up to float32's maximum and ties."""
  p = np.asarray(agg.capped_weights(jnp.asarray(counts), cap, mask=jnp.asarray(mask)))
  expected = ref.capped_weights_ref(counts, cap, mask)
  np.testing.assert_allclose(p, expected, atol=2e-6)
  active = (counts > 0) & mask
  assert np.all(p[~active] == 0)
  if active.any():
    np.testing.assert_allclose(p.sum(), 1.0, rtol=1e-5)
