"""pflax in real Flower federations on this machine (slow): Flower's deployment
engine (a SuperLink and one SuperNode process per client on 127.0.0.1) and its
simulation engine give exactly `pflax.simulate`'s rounds; a SuperNode killed
mid-run is dropped without harming the others; `pflax-run --flower`."""

import dataclasses
import json

import numpy as np
import pytest

pytest.importorskip("flwr")

from pflax import flower  # pylint: disable=wrong-import-position
from pflax import simulate  # pylint: disable=wrong-import-position
from pflax._src.cli import main as cli  # pylint: disable=wrong-import-position

pytestmark = pytest.mark.slow

CONFIG = simulate.ExperimentConfig(clients=4, rounds=3, local_epochs=1)


def _same_run(federated, simulated):
  """Per round: the same accuracies of every kind and dropped clients, and the
  training loss to float rounding (the server sums the clients' losses in
  float64, the engine in float32)."""
  assert len(federated.history) == len(simulated.history)
  for a, b in zip(federated.history, simulated.history):
    assert (a.round, a.accuracies, a.dropped_clients) == (
        b.round, b.accuracies, b.dropped_clients)
    np.testing.assert_allclose(a.train_loss, b.train_loss, rtol=1e-5)


@pytest.fixture(scope="module")
def deployment():
  with flower.LocalFederation(CONFIG.clients) as federation:
    yield federation


@pytest.mark.parametrize("name", ["cwfedavg", "fedrema"])
def test_a_deployed_federation_equals_the_simulation(deployment, name, tmp_path):
  results = deployment.run(flower.Experiment(name, CONFIG, seed=2), str(tmp_path))
  _same_run(results.runs[0], simulate.run(name, CONFIG, 2))
  traffic = results.config["flower"]["bytes_per_round"]
  assert len(traffic) == CONFIG.rounds
  assert all(r["train_sent"] > 0 and r["train_received"] > 0 for r in traffic)


def test_a_supernode_killed_mid_run_is_dropped_without_harming_the_others(tmp_path):
  """SuperNode 2 is killed (SIGKILL, with its client app) as soon as round 1 is
  recorded, while round 2 is under way. The server drops it from then on, and
  every round equals the in-process run in which client 2's messages are lost
  from the same round: the others are not harmed."""
  config = dataclasses.replace(CONFIG, rounds=4)
  with flower.LocalFederation(config.clients) as federation:
    def kill_after_round_1(done):
      if done == 1:
        federation.kill_node(2)
    run = federation.run(flower.Experiment("cwfedavg", config, 0), str(tmp_path),
                         timeout=20.0, on_round=kill_after_round_1).runs[0]
  dropped = [r.round for r in run.history if 2 in r.dropped_clients]
  assert dropped and dropped == list(range(dropped[0], config.rounds + 1))
  assert all(r.dropped_clients in ((), (2,)) for r in run.history)
  gone = dropped[0]
  lost = lambda message: (message.metadata.dst_node_id == 3
                          and message.metadata.group_id
                          and int(message.metadata.group_id) >= gone)
  grid = flower.InProcessGrid(flower.in_process_nodes(config.clients), lost=lost)
  expected = flower.run_in_process(flower.Experiment("cwfedavg", config, 0), grid)
  _same_run(run, expected.results().runs[0])
  assert np.all(np.isfinite(run.output_norms))


def test_flowers_simulation_engine_equals_the_simulation(tmp_path):
  with flower.LocalFederation(CONFIG.clients, simulation=True) as federation:
    results = federation.run(flower.Experiment("fedrema", CONFIG, 1), str(tmp_path))
  _same_run(results.runs[0], simulate.run("fedrema", CONFIG, 1))


@pytest.mark.parametrize("engine", ["deployment", "simulation"])
def test_pflax_run_flower_writes_the_simulations_results(engine, tmp_path):
  flags = ["--algorithms", "cwfedavg", "--clients", "3", "--rounds", "2",
           "--local-epochs", "1", "--no-progress", "--no-compilation-cache"]
  assert cli.main([*flags, "--flower", engine, "--out", str(tmp_path / "f")]) == 0
  assert cli.main([*flags, "--out", str(tmp_path / "s")]) == 0
  federated, simulated = (json.loads((tmp_path / d / "results.json").read_text())
                          for d in ("f", "s"))
  assert federated["config"]["flower"]["engine"] == engine
  assert (federated["runs"][0]["personalized_accuracy"]
          == simulated["runs"][0]["personalized_accuracy"])
  assert (tmp_path / "f" / "accuracy.png").exists()


USER_MODULE = """
from flax import nnx

class Net(nnx.Module):
  def __init__(self, rngs):
    self.body = nnx.Linear(64, 8, rngs=rngs)
    self.head = nnx.Linear(8, 10, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.body(x.reshape(x.shape[0], -1))))
"""


def test_a_deployed_federation_trains_an_nnx_model_named_by_an_import_string(
    tmp_path, monkeypatch):
  """The import string travels with the experiment; the server and every node
  import it from `PFLAX_BUILDER_PATH`, and the rounds equal the simulation's."""
  (tmp_path / "pflax_deployed_user_models.py").write_text(USER_MODULE)
  monkeypatch.syspath_prepend(str(tmp_path))
  from pflax_deployed_user_models import Net  # pylint: disable=import-error,import-outside-toplevel
  config = dataclasses.replace(CONFIG, clients=3, rounds=2)
  experiment = flower.Experiment("fedavg", config, 1,
                                 model="pflax_deployed_user_models:Net")
  with flower.LocalFederation(config.clients,
                              env={"PFLAX_BUILDER_PATH": str(tmp_path)}) as federation:
    results = federation.run(experiment, str(tmp_path / "out"))
  simulated = simulate.run("fedavg", config, 1, model=Net)
  _same_run(results.runs[0], simulated)
  np.testing.assert_allclose(results.runs[0].output_norms, simulated.output_norms,
                             rtol=1e-5)
