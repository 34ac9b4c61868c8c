"""Absurd values met during a run are errors or drops, never results (issue 34): a
client's reported training loss is checked like its upload, and a round in which
every participant is dropped stops the run with a one-line error naming why."""

import dataclasses
import re
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from pflax import simulate
from pflax._src.cli import main as cli
from pflax._src.simulation import experiment as experiment_lib
from pflax._src.simulation import faults as faults_lib

CONFIG = simulate.ExperimentConfig(clients=6, rounds=1, model="mlp", local_epochs=1,
                                   outlier_factor=None)
LIAR_CLASS = 9


def fedavg_reporting(bogus: float, every_client: bool):
  """FedAvg whose clients holding class 9 (or all) add `bogus` to their reported
  loss: a constant, so the trained models are FedAvg's own and finite."""
  def builder(model, optimizer):
    algorithm = experiment_lib.resolve_builder("fedavg")(model, optimizer)

    def loss(params, context, batch, key):
      lying = every_client or jnp.any((batch.y == LIAR_CLASS) & batch.mask)
      return algorithm.loss(params, context, batch, key) + jnp.where(lying, bogus, 0.0)
    return algorithm._replace(loss=loss)
  builder.__name__ = "fedavg_reporting"
  return builder


@pytest.fixture(scope="module")
def setup():
  return simulate.prepare(CONFIG, seed=0)


@pytest.mark.parametrize("bogus", [1e30, pytest.param(float("inf"),
                                                       marks=pytest.mark.slow)])
def test_a_client_reporting_an_absurd_loss_is_dropped_not_averaged(setup, bogus):
  run = simulate.run(fedavg_reporting(bogus, False), CONFIG, 0, setup=setup)
  liars = tuple(int(i) for i in np.flatnonzero(
      setup.federation.counts[:, LIAR_CLASS] > 0))
  record = run.history[0]
  assert liars and record.dropped_clients == liars
  assert 0 < record.train_loss < 10   # the others' cross-entropy only


def test_the_loss_bound_is_the_flower_servers_too():
  assert faults_lib.MAX_LOSS == 1e6
  assert not faults_lib.plausible_losses(jnp.array([1e6 * 1.01]))[0]
  assert faults_lib.plausible_losses(jnp.array([1e6]))[0]


def test_a_round_with_every_client_dropped_stops_the_run(setup):
  with pytest.raises(ValueError, match=r"^round 1 of fedavg_reporting seed 0: every "
                     r"participant was dropped .* lower lr or set grad_clip") as error:
    simulate.run(fedavg_reporting(1e30, True), CONFIG, 0, setup=setup)
  assert "\n" not in str(error.value)


@pytest.mark.slow
def test_with_faulty_clients_asked_an_empty_round_is_allowed(setup):
  config = dataclasses.replace(CONFIG, faulty_clients=0.2)
  run = simulate.run(fedavg_reporting(1e30, True), config, 0, setup=setup)
  assert run.history[0].dropped_clients == tuple(range(6))


_LYING = """\
import jax.numpy as jnp
from pflax import algorithms


def fedavg_lying(model, optimizer):
  algorithm = algorithms.fedavg(model, optimizer)
  def loss(params, context, batch, key):
    return algorithm.loss(params, context, batch, key) + 1e30
  return algorithm._replace(loss=loss)
"""


def test_pflax_run_stops_a_run_whose_every_client_is_dropped_in_one_line(
    tmp_path, monkeypatch):
  """The command line's end of the rule: a run in which every participant is
  dropped exits non-zero with one line naming the round and why, and writes
  no results as if it had trained."""
  (tmp_path / "lying.py").write_text(_LYING)
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "path", list(sys.path))
  out = tmp_path / "out"
  with pytest.raises(SystemExit) as error:
    cli.main(["--algorithms", "lying:fedavg_lying", "--clients", "4", "--rounds", "2",
              "--local-epochs", "1", "--model", "mlp", "--no-progress",
              "--no-compilation-cache", "--out", str(out)])
  message = str(error.value.code)
  assert error.value.code != 0 and "\n" not in message, message
  assert re.match(r"^pflax-run: round 1 of lying:fedavg_lying seed 0: every participant was "
                  r"dropped", message), message
  assert not (out / "results.json").exists()
