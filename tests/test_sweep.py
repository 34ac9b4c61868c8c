"""Sweeps: S runs as one vmapped program (or one threaded loop) equal S separate runs."""

import dataclasses
import logging

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pflax import data
from pflax import simulate
from pflax import train
from pflax._src.methods.algorithm import EVALUATED
from pflax._src.simulation import engine
from pflax._src.simulation import sharding
from pflax._src.simulation import simulate as simulate_lib

CONFIG = simulate.ExperimentConfig(clients=6, rounds=3, model="mlp", strategy="vmap",
                                   local_epochs=1)
SEEDS = (0, 1)


@pytest.fixture(scope="module")
def setups():
  return {s: simulate.prepare(CONFIG, s) for s in SEEDS}


def _tolerances(setup):
  """One test sample of slack, as float rounding may flip a near-tie prediction:
  1/total for sample-weighted accuracies; a flip of client i moves the unweighted
  mean over M clients by 1/(M n_i) and their std by at most 1/(sqrt(M) n_i)."""
  tests = np.asarray(setup.federation.test_mask.sum(axis=1))
  return 1.0 / tests.sum() + 1e-9, 1.0 / (np.sqrt(len(tests)) * tests.min()) + 1e-9


def _assert_same_run(swept, single, tolerance, client_tolerance):
  swept, single = swept.to_json(), single.to_json()
  assert swept["algorithm"] == single["algorithm"] and swept["seed"] == single["seed"]
  for a, b in zip(swept["history"], single["history"]):
    assert a["round"] == b["round"] and a["dropped_clients"] == b["dropped_clients"]
    assert a["faulty_clients"] == b["faulty_clients"]
    np.testing.assert_allclose(a["train_loss"], b["train_loss"], rtol=1e-4)
    for kind in EVALUATED:
      assert (f"{kind}_accuracy" in a) == (f"{kind}_accuracy" in b)
      if f"{kind}_accuracy" in a:
        np.testing.assert_allclose(a[f"{kind}_accuracy"], b[f"{kind}_accuracy"],
                                   atol=tolerance)
        for key in ("client_mean", "client_std"):
          np.testing.assert_allclose(a[f"{kind}_{key}"], b[f"{kind}_{key}"],
                                     atol=client_tolerance)
  np.testing.assert_allclose(swept["output_norms"], single["output_norms"], rtol=1e-4,
                             atol=1e-5)


SLOW = pytest.mark.slow


@pytest.mark.parametrize("name", ["cwfedavg", pytest.param("fedavg", marks=SLOW),
                                  pytest.param("feddwa", marks=SLOW),
                                  pytest.param("fedrema", marks=SLOW)])
def test_sweep_over_seeds_equals_separate_runs(setups, name):
  swept = simulate.sweep(name, CONFIG, SEEDS, setups=setups)
  for record, seed in zip(swept, SEEDS):
    single = simulate.run(name, CONFIG, seed, setup=setups[seed])
    _assert_same_run(record, single, *_tolerances(setups[seed]))


@pytest.mark.parametrize("name", ["fedrema", pytest.param("feddwa", marks=SLOW)])
def test_sweep_with_faulty_clients_equals_separate_runs(setups, name):
  # Issue 11, 14: a sweep draws the same faulty clients as `run`, round(0.4 * 3)
  # of the 3 participants, and drops them alike; FedReMa's personalized models
  # stay finite (issue 11, 8: it kept a faulty client's NaN classifier).
  config = dataclasses.replace(CONFIG, participation=0.5, faulty_clients=0.4,
                               momentum=0.9)
  swept = simulate.sweep(name, config, SEEDS, setups=setups)
  for record, seed in zip(swept, SEEDS):
    assert all(len(h.faulty_clients) == 1 for h in record.history)
    assert record.faulty_uploads == config.rounds
    assert np.isfinite(record.output_norms).all()
    assert all(np.isfinite(h.accuracy()) for h in record.history)
    single = simulate.run(name, config, seed, setup=setups[seed])
    _assert_same_run(record, single, *_tolerances(setups[seed]))


SETTINGS = {"pathological": dataclasses.replace(CONFIG, rounds=2, strategy="loop",
                                                samples_per_client=20),
            "dirichlet": dataclasses.replace(CONFIG, rounds=2, strategy="loop",
                                             samples_per_client=20,
                                             partition="dirichlet", dirichlet_alpha=0.5)}


@SLOW  # about 23 s on one CPU core: it compiles a sweep of 4 runs and one of 2
@pytest.mark.parametrize("name", ["fedavg", "fedper", "cwfedavg"])
def test_settings_side_by_side_equal_separate_sweeps(name):
  # Issue 30, item 3: the settings' partitions deal their clients different numbers
  # of samples (here within the same padded lengths, so that both settings' own
  # sweeps share one compiled program).
  rng = np.random.default_rng(0)
  dataset = data.from_arrays(rng.normal(size=(240, 6)).astype(np.float32),
                             rng.integers(0, 3, 240))
  setups = {setting: {s: simulate.prepare(config, s, dataset=dataset) for s in SEEDS}
            for setting, config in SETTINGS.items()}
  together = simulate.sweep_settings(name, SETTINGS, SEEDS, setups=setups)
  assert list(together) == list(SETTINGS)
  for setting, config in SETTINGS.items():
    assert [r.seed for r in together[setting]] == list(SEEDS)
    alone = simulate.sweep(name, config, SEEDS, setups=setups[setting])
    for record, single, seed in zip(together[setting], alone, SEEDS):
      _assert_same_run(record, single, *_tolerances(setups[setting][seed]))
  assert together["pathological"][0].history != together["dirichlet"][0].history


@pytest.mark.parametrize("changes,match", [
    ({"lr": 0.1}, r"differ in lr \(pathological: 0.05, dirichlet: 0.1\)"),
    ({"clients": 8}, r"differ in clients \(pathological: 6, dirichlet: 8\)"),
])
def test_settings_that_differ_beyond_the_partition_are_refused(monkeypatch, changes,
                                                                match):
  monkeypatch.setattr(simulate_lib, "_Grid", None)  # refused before any grid
  configs = {**SETTINGS, "dirichlet": dataclasses.replace(SETTINGS["dirichlet"],
                                                          **changes)}
  with pytest.raises(ValueError, match="may differ only in partition, .*; they " + match):
    simulate.sweep_settings("fedavg", configs, SEEDS)


@pytest.mark.parametrize("name,field,values", [
    pytest.param("feddwa", "alpha", (0.2, 0.9), marks=SLOW),
    pytest.param("cwfedavg", "wdr_coef", (0.0, 5.0), marks=SLOW),
    pytest.param("fedavg", "lr", (0.01, 0.1), marks=SLOW),
])
def test_hyperparameter_grid_equals_separate_runs(setups, name, field, values):
  swept = simulate.sweep(name, CONFIG, [0], hyperparameter=field, values=values,
                         setups=setups)
  assert [r.hyperparameter for r in swept] == [{field: v} for v in values]
  for record, value in zip(swept, values):
    config = (dataclasses.replace(CONFIG, lr=value) if field == "lr" else
              dataclasses.replace(CONFIG, hyperparameters={name: {field: value}}))
    single = simulate.run(name, config, 0, setup=setups[0])
    _assert_same_run(record, single, *_tolerances(setups[0]))
  first, second = (r.history[-1].train_loss for r in swept)
  assert first != second  # the value really reaches the computation


def test_sweep_compiles_once_and_is_deterministic(setups, caplog):
  compiles_after_round_2 = []

  def on_round(t, records):
    assert [r.round for r in records] == [t] * len(SEEDS)
    if t >= 2:
      compiles_after_round_2.extend(
          r for r in caplog.records if "Compiling" in r.getMessage())
    caplog.clear()

  config = dataclasses.replace(CONFIG, rounds=4)
  with jax.log_compiles(True), caplog.at_level(logging.WARNING):
    first = simulate.sweep("fedavg", config, SEEDS, setups=setups, on_round=on_round)
  assert not compiles_after_round_2, [r.getMessage()[:120] for r in
                                      compiles_after_round_2]
  second = simulate.sweep("fedavg", config, SEEDS, setups=setups)
  without_time = lambda runs: [{k: v for k, v in r.to_json().items() if k != "seconds"}
                               for r in runs]
  assert without_time(first) == without_time(second)
  assert first[0].history != first[1].history  # seeds differ


@pytest.mark.parametrize("kwargs,match", [
    ({"seeds": []}, "seeds"),
    ({"seeds": [0], "hyperparameter": "local_epochs", "values": [1.0]},
     "hyperparameter must be one of"),
    ({"seeds": [0], "hyperparameter": "alpha", "values": [0.5]},
     "hyperparameter must be one of"),  # a keyword of FedDWA, not of FedAvg
    ({"seeds": [0], "hyperparameter": "lr", "values": [-1.0]}, "lr must be a finite number in"),
    ({"seeds": [0], "hyperparameter": "lr", "values": [float("nan")]}, "values of lr"),
    ({"seeds": [0], "values": [0.1]}, "without a hyperparameter"),
])
def test_bad_grids_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    simulate.sweep("fedavg", CONFIG, **kwargs)


@pytest.mark.parametrize("name,field,value,match", [
    ("feddwa", "alpha", 1.5, "alpha must be a finite number in"),
    ("fedrema", "temperature", 0.0, "temperature must be a finite number in"),
    ("cwfedavg", "wdr_coef", -1.0, "wdr_coef must be"),
])
def test_each_swept_value_meets_the_builders_range(name, field, value, match):
  with pytest.raises(ValueError, match=match):
    simulate.sweep(name, CONFIG, [0], hyperparameter=field, values=[0.5, value])


def test_any_float_keyword_of_a_builder_is_sweepable():
  from pflax import algorithms  # pylint: disable=import-outside-toplevel
  assert simulate.sweepable(algorithms.cwfedavg) == ("lr", "wdr_coef")
  assert simulate.sweepable(algorithms.fedavg) == ("lr", "trim_fraction", "radius")
  assert set(simulate.sweepable(algorithms.fedclassavg)) == {
      "lr", "rho", "supcon_temperature", "supcon_base_temperature", "trim_fraction",
      "radius"}


@pytest.mark.parametrize("name,field,values", [
    ("cwfedavg", None, ()),
    ("fedclassavg", "rho", (0.1, 0.5)),  # warm-up phase, traced value
])
def test_looped_sweep_equals_vmapped_sweep(setups, name, field, values):
  looped = dataclasses.replace(CONFIG, strategy="loop")
  seeds = SEEDS if field is None else SEEDS[:1]
  kwargs = dict(hyperparameter=field, values=values, setups=setups)
  expected = simulate.sweep(name, CONFIG, seeds, **kwargs)
  for record, vmapped in zip(simulate.sweep(name, looped, seeds, **kwargs), expected):
    _assert_same_run(record, vmapped, *_tolerances(setups[record.seed]))


def test_sharded_loop_strategy_is_rejected():
  with pytest.raises(ValueError, match="a sharded sweep maps clients inside one"):
    sharding.strategy("loop", sharded=True)
  assert sharding.strategy("auto", sharded=True) == "vmap"
  assert sharding.strategy("auto") == train.default_strategy()


def _linear_trainer(value, w, context, x):
  """A client's "training": a value-scaled linear map, a dot with the client's weights."""
  return {"out": value * (x @ w) + context, "norm": jnp.sum(w * w)}


def _equations(jaxpr):
  """The equations of a jaxpr, those of nested jaxprs (scan, pjit, ...) included."""
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", param)
      if hasattr(inner, "eqns"):
        yield from _equations(inner)


@pytest.mark.parametrize("strategy", ["vmap", "map"])
@pytest.mark.parametrize("context_batched", [True, False])
def test_runs_train_on_one_client_axis(strategy, context_batched):
  # Issue 30: vmapped over runs, a round's local training takes the S x C clients of
  # all runs on one client axis (one batch dimension in every dot), with the results
  # of a vmap over runs of each run's vmap over clients (two batch dimensions).
  runs, clients = 3, 4
  rng = np.random.default_rng(0)
  values = jnp.asarray([0.5, 1.0, 2.0], jnp.float32)
  w = jnp.asarray(rng.normal(size=(runs, clients, 5, 2)), jnp.float32)
  x = jnp.asarray(rng.normal(size=(runs, clients, 7, 5)), jnp.float32)
  context = jnp.asarray(rng.normal(size=(runs, clients, 7, 2)) if context_batched
                        else rng.normal(size=(clients, 7, 2)), jnp.float32)
  in_axes = (0, 0, 0 if context_batched else None, 0)
  merged = jax.vmap(engine._runs_on_one_axis(_linear_trainer, strategy), in_axes)
  nested = jax.vmap(engine._one_run(_linear_trainer, strategy), in_axes)
  got, expected = merged(values, w, context, x), nested(values, w, context, x)
  chex.assert_trees_all_close(got, expected, rtol=1e-6)
  chex.assert_trees_all_equal_shapes(got, expected)
  for run in range(runs):  # each run alone, without the run axis
    run_context = context[run] if context_batched else context
    alone = engine._runs_on_one_axis(_linear_trainer, strategy)(values[run], w[run],
                                                                 run_context, x[run])
    chex.assert_trees_all_close(jax.tree.map(lambda a: a[run], got), alone, rtol=1e-6)
  equations = lambda fn, name: [eqn for eqn in _equations(
      jax.make_jaxpr(fn)(values, w, context, x).jaxpr) if eqn.primitive.name == name]
  if strategy == "vmap":  # the number of batch dimensions of every dot
    batch_dims = lambda fn: {len(eqn.params["dimension_numbers"][1][0])
                             for eqn in equations(fn, "dot_general")}
    assert batch_dims(merged) == {1} and batch_dims(nested) == {2}
  else:  # one loop over the clients, as many at a time as there are runs
    loops = lambda fn: [eqn.params["length"] for eqn in equations(fn, "scan")]
    assert loops(merged) == loops(nested) == [clients]


def test_runs_merge_their_clients_unless_the_clients_are_split_over_devices(setups):
  grid = lambda mesh: simulate_lib._Grid(  # pylint: disable=protected-access
      "fedavg", CONFIG, list(SEEDS), None, (), {(None, s): setups[s] for s in SEEDS}, mesh)
  mesh = jax.make_mesh((1,), ("clients",), axis_types=(jax.sharding.AxisType.Auto,))
  assert grid(None).plan.merge_runs
  assert not grid(mesh).plan.merge_runs
