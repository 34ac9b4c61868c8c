"""Absurd values met during a run are errors or drops, never results (issue 34): a
client's reported training loss is checked like its upload, and a round in which
every participant is dropped stops the run with a one-line error naming why."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from pflax import simulate
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
