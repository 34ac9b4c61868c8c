"""pflax in a Flower federation: records, the strategy and client app, equivalence
with `pflax.simulate`, dropped clients (in one process: `InProcessGrid`)."""

import dataclasses
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr import app as flwr_app  # pylint: disable=wrong-import-position
from flwr import clientapp as flwr_clientapp  # pylint: disable=wrong-import-position
from flwr.supercore import task_identity  # pylint: disable=wrong-import-position

from pflax import flower  # pylint: disable=wrong-import-position
from pflax import simulate  # pylint: disable=wrong-import-position
from pflax._src.cli import main as cli  # pylint: disable=wrong-import-position
from pflax._src.simulation import faults as faults_lib
from pflax._src.simulation import keys as keys_lib
from pflax._src.simulation import simulate as simulate_lib  # pylint: disable=wrong-import-position

CONFIG = simulate.ExperimentConfig(clients=4, rounds=3, local_epochs=1)


def _extended(*names):
  """`names` as parameters marked `extended`: CI's slow pass runs the others."""
  return [pytest.param(n, marks=pytest.mark.extended) for n in names]


def _accuracies(record, kind="personalized"):
  return [h.accuracies[kind].accuracy for h in record.history]


def _same_run(federated, simulated):
  """Per round: the same accuracies of every kind, dropped clients and (to float
  rounding: the server sums the clients' losses in float64) training loss."""
  assert len(federated.history) == len(simulated.history)
  for a, b in zip(federated.history, simulated.history):
    assert a.round == b.round
    assert a.accuracies == b.accuracies
    assert a.dropped_clients == b.dropped_clients
    np.testing.assert_allclose(a.train_loss, b.train_loss, rtol=1e-5)


def test_trees_travel_as_named_arrays_and_come_back_exactly():
  tree = {"dense": {"kernel": np.arange(6, dtype=np.float32).reshape(2, 3),
                    "bias": np.zeros(3, np.float32)}, "step": np.int32(7)}
  record = flower.to_record(tree)
  assert sorted(record) == ["['dense']['bias']", "['dense']['kernel']", "['step']"]
  back = flower.from_record(record, tree)
  assert jax.tree.structure(back) == jax.tree.structure(tree)
  jax.tree.map(np.testing.assert_array_equal, back, tree)


@pytest.mark.parametrize("change, match", [
    (lambda t: {**t, "extra": np.ones(1)}, r"\['extra'\]"),
    (lambda t: {"dense": t["dense"]}, r"\['step'\]"),
    (lambda t: {**t, "step": np.ones(2, np.int32)}, r"must be int32\(\), got int32\(2,\)"),
    (lambda t: {**t, "step": np.float32(7)}, r"must be int32\(\), got float32\(\)"),
])
def test_a_record_of_another_tree_is_a_clear_error(change, match):
  tree = {"dense": {"kernel": np.ones((2, 3), np.float32)}, "step": np.int32(7)}
  with pytest.raises(ValueError, match=match):
    flower.from_record(flower.to_record(change(tree)), tree, "model")


def test_the_client_app_pickles_for_flowers_simulation_engine():
  """Flower's simulation engine sends the ClientApp to its Ray actors with
  cloudpickle; an app that does not pickle loses Flower's actors one by one
  ("pop from empty list")."""
  cloudpickle = pytest.importorskip("ray.cloudpickle")
  app = cloudpickle.loads(cloudpickle.dumps(flower.client_app()))
  assert isinstance(app, flwr_clientapp.ClientApp)


@pytest.mark.parametrize("name", ["cwfedavg", "fedrema"])
def test_a_federation_equals_the_simulation(name):
  """The headline equivalence: the same data, partition and seed give exactly the
  same per-round accuracies in Flower messages as in `pflax.simulate`."""
  federated = flower.run_in_process(flower.Experiment(name, CONFIG, seed=3))
  simulated = simulate.run(name, CONFIG, 3)
  _same_run(federated.results().runs[0], simulated)
  assert federated.results().config["flower"]["bytes_per_round"][0]["train_sent"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fedclassavg", "fedsa", *_extended(
    "local", "fedavg", "fedprox", "feddwa")])
def test_every_algorithm_in_a_federation_equals_the_simulation(name):
  config = dataclasses.replace(CONFIG, participation=0.5)
  federated = flower.run_in_process(flower.Experiment(name, config, seed=1))
  _same_run(federated.results().runs[0], simulate.run(name, config, 1))


@pytest.mark.slow
@pytest.mark.parametrize("name", _extended("ditto", "fedbabu",
    "fedper", "fedavg_ft", "fedrep", "apfl", "moon", "fedala"))
def test_every_baseline_in_a_federation_equals_the_simulation(name):
  config = dataclasses.replace(CONFIG, participation=0.5)
  federated = flower.run_in_process(flower.Experiment(name, config, seed=1))
  _same_run(federated.results().runs[0], simulate.run(name, config, 1))


@pytest.mark.slow
@pytest.mark.extended   # minutes on 2 cores: run by hand (-m extended)
def test_heterogeneous_fedclassavg_in_a_federation_equals_the_simulation():
  """One architecture per node (client i trains `mlp_family()[i % 4]` with its
  group's loss and optimizer): the server warms up and aggregates the shared
  classifier over every group with the engine's steps, as `pflax.simulate` does."""
  config = dataclasses.replace(CONFIG, clients=5, rounds=2, participation=0.6,
                               heterogeneous=True, family="mlp")
  federated = flower.run_in_process(flower.Experiment("fedclassavg", config, seed=2))
  simulated = simulate.run("fedclassavg", config, 2)
  _same_run(federated.results().runs[0], simulated)
  np.testing.assert_allclose(federated.results().runs[0].output_norms,
                             simulated.output_norms, rtol=1e-5)


def _engine_faulty(seed, config, server_round):
  """The clients the engine makes faulty in a round (`faulty_clients`)."""
  sample_key = keys_lib.round_keys(keys_lib.run_keys(seed)[2], server_round - 1)[0]
  chosen = keys_lib.participants(jax.random.fold_in(sample_key, 0), config.clients,
                               config.participation)
  took_part = np.zeros(config.clients, bool)
  took_part[np.asarray(chosen)] = True
  count = faults_lib.num_faulty(config.faulty_clients, len(chosen))
  return set(np.flatnonzero(faults_lib.faulty_clients(
      jax.random.fold_in(sample_key, faults_lib.FAULT_STREAM), took_part, count)).tolist())


def _simulated_correct(name, config, seed):
  """The simulation's correct test predictions per client after every round,
  `[{kind: (M,)}]`, and each client's number of test samples."""
  grid = simulate_lib._Grid(name, config, [seed], None, (), None, None)  # pylint: disable=protected-access
  carry, correct = grid.start(), []
  for t in range(config.rounds):
    carry, _ = grid.round(carry, t)
    correct.append({kind: c[0] for kind, c in grid.evaluate(carry)[0].items()})
  return correct, grid.tests[0]


@pytest.mark.slow
def test_a_client_that_disconnects_mid_round_is_dropped_as_a_faulty_one():
  """A lost reply is exactly the engine's faulty upload: that client is dropped
  from the round and every other client goes on as in the simulation. Its node
  is not asked to evaluate in that round, so the round's accuracies are the
  simulation's over the other clients (`evaluated_clients`)."""
  faulty = dataclasses.replace(CONFIG, clients=5, faulty_clients=0.2, rounds=4)
  simulated = simulate.run("cwfedavg", faulty, 0)
  assert any(h.dropped_clients for h in simulated.history)

  healthy = dataclasses.replace(faulty, faulty_clients=0.0)
  lost = lambda message: (
      message.metadata.message_type == "train"
      and int(message.content["config"]["client"]) in _engine_faulty(
          0, faulty, int(message.metadata.group_id)))
  grid = flower.InProcessGrid(flower.in_process_nodes(5), lost=lost)
  federated = flower.run_in_process(flower.Experiment("cwfedavg", healthy, 0), grid)
  correct, tests = _simulated_correct("cwfedavg", faulty, 0)
  for a, b, c in zip(federated.results().runs[0].history, simulated.history, correct,
                     strict=True):
    assert a.dropped_clients == b.dropped_clients
    np.testing.assert_allclose(a.train_loss, b.train_loss, rtol=1e-5)
    evaluated = [i for i in range(5) if i not in b.dropped_clients]
    assert a.evaluated_clients == tuple(evaluated)
    assert a.accuracies == {kind: simulate.Accuracy.of(c[kind][evaluated],
                                                       tests[evaluated])
                            for kind in c}


def _failing_app(client, phase="train"):
  """The ClientApp, except that `client` fails (raises) in `phase`."""
  app = flower.client_app()

  def maybe_failing(message, context):
    if (flower.client_id(context) == client
        and message.metadata.message_type == phase):
      raise RuntimeError("the node crashed")
    return app(message, context)
  return maybe_failing


def test_a_failing_client_is_dropped_without_harming_the_others():
  grid = flower.InProcessGrid(flower.in_process_nodes(4, _failing_app(2)))
  run = flower.run_in_process(flower.Experiment("fedrema", CONFIG, 0),
                                  grid).results().runs[0]
  assert all(h.dropped_clients == (2,) for h in run.history)
  assert all(np.isfinite(h.train_loss) for h in run.history)
  assert run.history[-1].accuracies["personalized"].accuracy > 0.4
  assert np.all(np.isfinite(run.output_norms))


def test_a_client_uploading_nan_is_dropped():
  app = flower.client_app()

  def poisoned(message, context):
    reply = app(message, context)
    if flower.client_id(context) == 1 and message.metadata.message_type == "train":
      model = reply.content["model"]
      for key in list(model):
        model[key] = flwr_app.Array(np.full_like(model[key].numpy(), np.nan))
    return reply

  grid = flower.InProcessGrid(flower.in_process_nodes(4, poisoned))
  run = flower.run_in_process(flower.Experiment("cwfedavg", CONFIG, 0),
                                  grid).results().runs[0]
  assert all(h.dropped_clients == (1,) for h in run.history)
  assert np.all(np.isfinite(run.output_norms))


def test_an_unregistered_or_duplicate_partition_is_a_clear_error():
  nodes = flower.in_process_nodes(4, node_config=lambda i: {"partition-id": i % 3})
  with pytest.raises(RuntimeError, match="partition-id"):
    flower.run_in_process(flower.Experiment("fedavg", CONFIG, 0),
                              flower.InProcessGrid(nodes))


@pytest.fixture
def message_identity(monkeypatch):
  """The identity a Flower message needs, as `run_in_process` sets it."""
  for name in ("_run_id", "_node_id", "_task_id"):
    monkeypatch.setattr(task_identity.TaskIdentity, name, 1)


@pytest.mark.usefixtures("message_identity")
def test_registration_stacks_the_clients_by_id_whatever_the_reply_order():
  # Node i + 1 is client 3 - i: the replies come in reverse client order.
  nodes = flower.in_process_nodes(4, node_config=lambda i: {"partition-id": 3 - i})
  strategy = flower.PflaxStrategy(flower.Experiment("cwfedavg", CONFIG, 0))
  strategy.register(flower.InProcessGrid(nodes), timeout=0.0)
  assert strategy.nodes == {3 - i: i + 1 for i in range(4)}
  federation = simulate.prepare(CONFIG, 0).federation
  np.testing.assert_array_equal(strategy.class_counts, federation.counts)
  np.testing.assert_array_equal(strategy.tests, federation.test_mask.sum(axis=1))


def test_a_node_without_partition_id_says_how_to_start_it():
  nodes = flower.in_process_nodes(4, node_config=lambda i: {})
  with pytest.raises(RuntimeError, match="--node-config 'partition-id=0'"):
    flower.run_in_process(flower.Experiment("fedavg", CONFIG, 0),
                              flower.InProcessGrid(nodes))


@pytest.mark.parametrize("name, change, match", [
    ("feddwa", dict(heterogeneous=True), "heterogeneous models need an algorithm that "
                                         "shares a head"),
    ("fedclassavg", dict(faulty_clients=0.1), "faulty_clients"),
    ("fedclassavg", dict(clients=0), "clients"),
])
def test_experiments_a_federation_does_not_run_are_refused(name, change, match):
  with pytest.raises(ValueError, match=match):
    flower.PflaxStrategy(flower.Experiment(name, dataclasses.replace(CONFIG, **change)))


def test_the_experiment_travels_as_json_unchanged():
  config = dataclasses.replace(CONFIG, hyperparameters={"cwfedavg": {"wdr_coef": 2.0}})
  experiment = flower.Experiment("cwfedavg", config, 5)
  assert flower.Experiment.from_json(experiment.to_json()) == experiment


def test_pack_sends_each_distinct_array_once_and_unpacks_exactly():
  kernel = np.arange(6, dtype=np.float32).reshape(2, 3)
  tree = {"model": {"kernel": kernel, "bias": np.zeros(3, np.float32)},
          "context": {"kernel": kernel.copy(), "bias": np.zeros(3, np.float64)},
          "nan": np.full(3, np.nan, np.float32), "nan_too": np.full(3, np.nan,
                                                                    np.float32)}
  arrays, same = flower.pack(tree)
  # The first of equal leaves in the tree's order is sent; float64 zeros are
  # not float32 zeros; NaNs of the same bytes are equal.
  assert dict(same) == {"['model']['kernel']": "['context']['kernel']",
                        "['nan_too']": "['nan']"}
  assert len(arrays) == 4
  back = flower.unpack(arrays, same, tree)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b) or
               np.testing.assert_equal(a.dtype, b.dtype), back, tree)


def test_unpack_refuses_a_reference_to_an_array_not_sent():
  tree = {"a": np.ones(2, np.float32), "b": np.ones(2, np.float32)}
  arrays, same = flower.pack(tree)
  del arrays["['a']"]
  with pytest.raises(ValueError, match=r"model: \['b'\] refers to \['a'\]"):
    flower.unpack(arrays, same, tree, "model")


def test_fedprox_sends_its_anchor_once():
  """FedProx's loss context is the model it starts from: the train message holds
  one copy of it, as FedAvg's does."""
  config = dataclasses.replace(CONFIG, rounds=1)
  sent = {name: flower.run_in_process(flower.Experiment(name, config, 0)).results(
      ).config["flower"]["bytes_per_round"][0]["train_sent"]
          for name in ("fedavg", "fedprox")}
  assert abs(sent["fedprox"] - sent["fedavg"]) < 0.01 * sent["fedavg"]


@pytest.mark.parametrize("flags, match", [
    (["--devices", "1"], "--devices is for simulations"),
    (["--sweep", "lr", "--values", "0.1"], "--sweep is for simulations"),
    (["--checkpoint-every", "2"], "--checkpoint-every is for simulations"),
    (["--resume"], "--resume is for simulations"),
    (["--flower-timeout", "0"], r"--flower-timeout must be in \(0, 86400"),
    (["--faulty-clients", "0.1"], "--flower: --faulty-clients"),
    (["--algorithms", "fedavg", "--dp-clip", "1", "--dp-noise-multiplier", "1"],
     "^pflax-run: --flower: --dp-clip: client-level DP runs in simulations only"),
])
def test_pflax_run_flower_refuses_what_a_federation_does_not_run(flags, match,
                                                                  tmp_path):
  with pytest.raises(SystemExit, match=match):
    cli.main(["--flower", "--out", str(tmp_path), *flags])


def test_the_app_and_run_config_for_flwr_run(tmp_path):
  tomllib = pytest.importorskip("tomllib")      # Python 3.11+
  app = flower.write_app(str(tmp_path / "app"))
  with open(os.path.join(app, "pyproject.toml"), "rb") as f:
    components = tomllib.load(f)["tool"]["flwr"]["app"]["components"]
  assert components == {"serverapp": "pflax._src.flower.apps:serverapp",
                        "clientapp": "pflax._src.flower.apps:clientapp"}
  experiment = flower.Experiment("fedsa", CONFIG, 4)
  path = flower.write_run_config(str(tmp_path / "run.toml"), experiment, "out", 9.0)
  with open(path, "rb") as f:
    run_config = tomllib.load(f)
  assert flower.Experiment.from_json(run_config["experiment"]) == experiment
  assert (run_config["out"], run_config["timeout"]) == ("out", 9.0)


def test_a_malformed_evaluation_is_dropped_not_counted():
  """A node answering with an impossible correct count (more than its test
  samples) is left out of that round's accuracy, as a silent node would be."""
  app = flower.client_app()

  def lying(message, context):
    reply = app(message, context)
    if flower.client_id(context) == 3 and message.metadata.message_type == "evaluate":
      reply.content["metrics"]["correct-personalized"] = 10**6
    return reply

  config = dataclasses.replace(CONFIG, rounds=1)
  honest = flower.run_in_process(flower.Experiment("fedavg", config, 0))
  lost = lambda message: (message.metadata.message_type == "evaluate"
                          and message.metadata.dst_node_id == 4)
  silent = flower.run_in_process(
      flower.Experiment("fedavg", config, 0),
      flower.InProcessGrid(flower.in_process_nodes(4), lost=lost))
  liar = flower.run_in_process(
      flower.Experiment("fedavg", config, 0),
      flower.InProcessGrid(flower.in_process_nodes(4, lying)))
  accuracy = lambda s: s.results().runs[0].history[0].accuracies["personalized"]
  assert accuracy(liar) == accuracy(silent) != accuracy(honest)


def test_importing_pflax_flower_builds_no_app():
  """The apps of `pflax-run --flower` are built where Flower's processes import
  them (`pflax._src.flower.apps`), not by `import pflax.flower`."""
  code = ("import sys, pflax.flower\n"
          "assert 'pflax._src.flower.apps' not in sys.modules\n"
          "assert not hasattr(pflax.flower, 'clientapp')\n"
          "from pflax._src.flower import apps\n"
          "from flwr.clientapp import ClientApp\n"
          "from flwr.serverapp import ServerApp\n"
          "assert isinstance(apps.clientapp, ClientApp)\n"
          "assert isinstance(apps.serverapp, ServerApp)\n")
  subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
