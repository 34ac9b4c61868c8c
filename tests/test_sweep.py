"""Sweeps: S runs as one vmapped program (or one threaded loop) equal S separate runs."""

import dataclasses
import logging

import jax
import numpy as np
import pytest

from pflax import algorithms
from pflax import simulate
from pflax import train
from pflax._src import sweep as sweep_lib

CONFIG = simulate.ExperimentConfig(
    clients=6, rounds=3, model="mlp", strategy="vmap",
    hp=algorithms.Hyperparameters(local_epochs=1))
SEEDS = (0, 1)


@pytest.fixture(scope="module")
def setups():
  return {s: simulate.prepare(CONFIG, s) for s in SEEDS}


def _assert_same_run(swept, single, tolerance):
  assert swept["algorithm"] == single["algorithm"] and swept["seed"] == single["seed"]
  for a, b in zip(swept["history"], single["history"]):
    assert a["round"] == b["round"] and a["dropped_clients"] == b["dropped_clients"]
    np.testing.assert_allclose(a["train_loss"], b["train_loss"], rtol=1e-4)
    for key in ("personalized_accuracy", "global_accuracy"):
      assert (key in a) == (key in b)
      if key in a:
        np.testing.assert_allclose(a[key], b[key], atol=tolerance)
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
    # One test sample of slack: float rounding may flip a near-tie prediction.
    total = int(setups[seed].federation.test_valid.sum())
    _assert_same_run(record, single, tolerance=1.0 / total + 1e-9)


@pytest.mark.parametrize("name,field,values", [
    pytest.param("feddwa", "feddwa_alpha", (0.2, 0.9), marks=SLOW),
    pytest.param("cwfedavg", "wdr_coef", (0.0, 5.0), marks=SLOW),
    pytest.param("fedavg", "lr", (0.01, 0.1), marks=SLOW),
])
def test_hyperparameter_grid_equals_separate_runs(setups, name, field, values):
  swept = simulate.sweep(name, CONFIG, [0], hyperparameter=field, values=values,
                         setups=setups)
  assert [r["hyperparameter"] for r in swept] == [{field: v} for v in values]
  for record, value in zip(swept, values):
    config = dataclasses.replace(
        CONFIG, hp=dataclasses.replace(CONFIG.hp, **{field: value}))
    single = simulate.run(name, config, 0, setup=setups[0])
    total = int(setups[0].federation.test_valid.sum())
    _assert_same_run(record, single, tolerance=1.0 / total + 1e-9)
  first, second = (r["history"][-1]["train_loss"] for r in swept)
  assert first != second  # the value really reaches the computation


def test_sweep_compiles_once_and_is_deterministic(setups, caplog):
  compiles_after_round_2 = []

  def on_round(t, records):
    assert [r["round"] for r in records] == [t] * len(SEEDS)
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
  without_time = lambda runs: [{k: v for k, v in r.items() if k != "seconds"}
                               for r in runs]
  assert without_time(first) == without_time(second)
  assert first[0]["history"] != first[1]["history"]  # seeds differ


@pytest.mark.parametrize("kwargs,match", [
    ({"seeds": []}, "seeds"),
    ({"seeds": [0], "hyperparameter": "local_epochs", "values": [1.0]},
     "hyperparameter must be one of"),
    ({"seeds": [0], "hyperparameter": "feddwa_alpha", "values": [1.5]},
     "values of feddwa_alpha"),
    ({"seeds": [0], "hyperparameter": "lr", "values": [float("nan")]}, "values of lr"),
    ({"seeds": [0], "values": [0.1]}, "without a hyperparameter"),
])
def test_bad_grids_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    simulate.sweep("fedavg", CONFIG, **kwargs)


@pytest.mark.parametrize("name,field,values", [
    ("cwfedavg", None, ()),
    ("fedclassavg", "fedclassavg_rho", (0.1, 0.5)),  # warm-up phase, traced value
])
def test_looped_sweep_equals_vmapped_sweep(setups, name, field, values):
  looped = dataclasses.replace(CONFIG, strategy="loop")
  seeds = SEEDS if field is None else SEEDS[:1]
  kwargs = dict(hyperparameter=field, values=values, setups=setups)
  expected = simulate.sweep(name, CONFIG, seeds, **kwargs)
  for record, vmapped in zip(simulate.sweep(name, looped, seeds, **kwargs), expected):
    total = int(setups[record["seed"]].federation.test_valid.sum())
    _assert_same_run(record, vmapped, tolerance=1.0 / total + 1e-9)


def test_sharded_loop_strategy_is_rejected():
  with pytest.raises(ValueError, match="a sharded sweep maps clients inside one"):
    sweep_lib.sweep_strategy("loop", sharded=True)
  assert sweep_lib.sweep_strategy("auto", sharded=True) == "vmap"
  assert sweep_lib.sweep_strategy("auto") == train.default_strategy()
