"""The one engine: keys, records, checkpoints, heterogeneity, processes, compile counts."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import serialization

from pflax import algorithms
from pflax import models
from pflax import simulate
from pflax._src.core import prng
from pflax._src.simulation import faults as faults_lib
from pflax._src.simulation import groups
import pflax

CONFIG = simulate.ExperimentConfig(clients=6, rounds=2, model="mlp", local_epochs=1)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _draws(key):
  k1, k2 = jax.random.split(key)
  k3 = jax.random.fold_in(k2, 7)
  return [jax.random.uniform(k1, (3, 5)), jax.random.normal(k3, (4, 4, 2)),
          jax.random.permutation(k1, 20), jax.random.randint(k3, (7,), 0, 9),
          jax.random.bernoulli(k2, 0.3, (11,)),
          jax.random.uniform(k1, (5,), dtype=jnp.float16),
          jax.vmap(lambda k: jax.random.uniform(k, (2,)))(jax.random.split(k3, 5)),
          jax.random.key_data(jax.random.split(k3, (2, 3)))]


@pytest.mark.parametrize("partitionable", [False, True])
def test_pflax_keys_are_classic_threefry_whatever_the_flag(partitionable):
  with jax.threefry_partitionable(False):
    expected = _draws(jax.random.PRNGKey(3))
  with jax.threefry_partitionable(partitionable):
    got = _draws(prng.key(3))
  for a, b in zip(expected, got):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.asarray(a).dtype == np.asarray(b).dtype


def _library_history(seed):
  script = textwrap.dedent(f"""
      import json
      from pflax import simulate
      config = simulate.ExperimentConfig(clients=6, rounds=2, model="mlp", local_epochs=1)
      run = simulate.run("fedrema", config, {seed})
      print(json.dumps(run.to_json()["history"]))
  """)
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       check=True, cwd=REPO)
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_cli_and_library_draw_the_same_numbers_in_fresh_processes(tmp_path):
  # Issue 12, 6: the CLI used to set jax_threefry_partitionable globally.
  subprocess.run([sys.executable, "-m", "pflax", "--algorithms", "fedrema", "--clients",
                  "6", "--rounds", "2", "--model", "mlp", "--local-epochs", "1",
                  "--seeds", "1", "--out", str(tmp_path), "--no-progress"],
                 capture_output=True, text=True, check=True, cwd=REPO)
  cli_history = json.loads((tmp_path / "results.json").read_text())["runs"][0]["history"]
  assert cli_history == _library_history(1)


def test_a_run_compiles_a_handful_of_programs():
  script = textwrap.dedent("""
      import logging
      import jax
      from pflax import simulate
      compiles = []
      class Count(logging.Handler):
        def emit(self, record):
          if "Finished XLA compilation" in record.getMessage():
            compiles.append(record.getMessage())
      logging.getLogger("jax").addHandler(Count())
      config = simulate.ExperimentConfig(clients=6, rounds=3, model="mlp", local_epochs=1)
      setup = simulate.prepare(config, 0)
      with jax.log_compiles(True):
        simulate.run("fedavg", config, 0, setup=setup)
      print(len(compiles))
  """)
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       check=True, cwd=REPO)
  count = int(out.stdout.strip().splitlines()[-1])
  # The initial models and state, the round's draws, inputs, checks and server
  # step, the loop's three (one client, output buffers, in-place writes), the
  # evaluation and the seed's key program: 11 (was 71).
  assert 0 < count <= 11, count


def test_import_pflax_reaches_every_namespace():
  script = ("import pflax\n"
            "print(sorted(n for n in pflax.__all__\n"
            "             if hasattr(getattr(pflax, n), '__all__')))\n"
            "print(pflax.simulate.sweep.__name__,\n"
            "      pflax.algorithms.METHODS['fedavg'].builder.__name__)")
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       check=True, cwd=REPO)
  names, functions = out.stdout.strip().splitlines()
  assert names == str(["aggregate", "algorithms", "data", "losses", "models",
                       "simulate", "train", "tree", "tune"])
  assert functions == "sweep fedavg"


def test_public_names_are_unique_across_namespaces():
  """A name means one object in every namespace, but for a method's family: its
  builder `pflax.algorithms.X` and its server step's aggregator `pflax.aggregate.X`."""
  seen, family = {}, set()
  for namespace in pflax.__all__:
    for name in getattr(pflax, namespace).__all__:
      obj = getattr(getattr(pflax, namespace), name)
      if namespace == "aggregate" and name in pflax.algorithms.METHODS:
        assert pflax.algorithms.METHODS[name].builder is pflax.algorithms.__dict__[name]
        family.add(name)
        continue
      assert seen.setdefault(name, obj) is obj, (namespace, name)
  assert family == {"fedavg", "fedclassavg", "fedsa", "feddwa", "fedrema"}


@pytest.fixture(scope="module")
def setup():
  return simulate.prepare(CONFIG, 0)


def test_records_round_trip_through_json(setup, tmp_path):
  run = simulate.run("feddwa", CONFIG, 0, setup=setup)
  results = simulate.Results({"clients": 6}, setup.federation.counts, (run,))
  results.save(str(tmp_path / "results.json"))
  loaded = simulate.Results.load(str(tmp_path / "results.json"))
  assert loaded.to_json() == results.to_json()
  assert loaded.runs[0].summary("exclusive") == run.summary("exclusive")
  assert loaded.runs[0].history[1].accuracies == run.history[1].accuracies


class _Killed(Exception):
  pass


def test_sweep_checkpoint_is_msgpack_and_resumes_exactly(setup, tmp_path):
  config = dataclasses.replace(CONFIG, rounds=3)
  setups = {0: setup, 1: simulate.prepare(config, 1)}
  uninterrupted = simulate.sweep("cwfedavg", config, [0, 1], setups=setups)

  def kill_at_round_3(t, rounds):
    if t == 3:
      raise _Killed

  with pytest.raises(_Killed):
    simulate.sweep("cwfedavg", config, [0, 1], setups=setups, on_round=kill_at_round_3,
                   checkpoint_dir=str(tmp_path), checkpoint_every=2)
  (path,) = tmp_path.iterdir()
  payload = serialization.msgpack_restore(path.read_bytes())  # plain data, no code
  assert payload["round"] == 2
  resumed = simulate.sweep("cwfedavg", config, [0, 1], setups=setups,
                           checkpoint_dir=str(tmp_path), resume=True)
  strip = lambda runs: [{k: v for k, v in r.to_json().items() if k != "seconds"}
                        for r in runs]
  assert strip(resumed) == strip(uninterrupted)


@pytest.mark.parametrize("content", [b"", b"\x00garbage", b"\x81\xa5round\x02"])
def test_corrupt_checkpoint_is_a_clear_error(setup, tmp_path, content):
  simulate.run("fedavg", CONFIG, 0, setup=setup, checkpoint_dir=str(tmp_path),
               checkpoint_every=1)
  (path,) = tmp_path.iterdir()
  path.write_bytes(content)
  with pytest.raises(ValueError, match="corrupt or not a pflax checkpoint"):
    simulate.run("fedavg", CONFIG, 0, setup=setup, checkpoint_dir=str(tmp_path),
                 resume=True)


def _two_architectures():
  """Two MLPs whose output layers have one shape (hidden widths differ)."""
  return (models.MLP(3, hidden=(4, 5)), models.MLP(3, hidden=(6, 5)))


def test_heterogeneous_classifier_averaging_averages_heads_across_architectures():
  family = _two_architectures()
  het = algorithms.heterogeneous(
      lambda m: algorithms.fedclassavg(m, optax.sgd(0.1)), family)
  assert isinstance(het, algorithms.Algorithm) and het.architectures.models == family
  assert [list(c) for c in groups.as_groups(het, family[0], num_clients=5).clients] == [
      [0, 2, 4], [1, 3]]
  rng = np.random.default_rng(0)
  key = jax.random.key(0)

  def stacked(model, m):
    shapes = jax.eval_shape(model.init, key, jnp.zeros((1, 16)))["params"]
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(size=(m, *s.shape)),
                                              jnp.float32), shapes)

  init = (stacked(family[0], 3), stacked(family[1], 2))
  counts = jnp.asarray([[1, 0, 0], [0, 2, 0], [0, 0, 3], [1, 1, 2], [5, 0, 0]])
  state = het.init(init, counts, key)
  trained = (stacked(family[0], 3), stacked(family[1], 2))
  mask = jnp.array([True, True, True, False, True])     # client 3: group 1's second
  new = het.server_update(state, trained, mask, key)
  # Sample-weighted mean over the 4 healthy clients, in client order 0..4.
  kernels = np.zeros((5, 5, 3))
  kernels[[0, 2, 4]] = trained[0]["classifier"]["output"]["kernel"]
  kernels[[1, 3]] = trained[1]["classifier"]["output"]["kernel"]
  weights = np.array([1.0, 2.0, 3.0, 0.0, 5.0])
  expected = np.tensordot(weights / weights.sum(), kernels, 1)
  np.testing.assert_allclose(new.shared.head["classifier"]["output"]["kernel"], expected,
                             rtol=1e-5)
  # Each group's own layers: trained where healthy, kept where not.
  np.testing.assert_array_equal(new.own[0]["features"]["dense_0"]["kernel"],
                                trained[0]["features"]["dense_0"]["kernel"])
  np.testing.assert_array_equal(new.own[1]["features"]["dense_0"]["kernel"][1],
                                init[1]["features"]["dense_0"]["kernel"][1])
  # Every client trains from its own layers with the averaged head.
  starts = het.client_models(new)
  for start in starts:
    kernel = start["classifier"]["output"]["kernel"]
    np.testing.assert_allclose(kernel, np.broadcast_to(expected, kernel.shape), rtol=1e-5)


@pytest.mark.parametrize("num_clients, clients", [
    (7, [[0, 3, 6], [1, 4], [2, 5]]),
    (2, [[0], [1]]),                                # M < G: the first M architectures
])
def test_groups_deal_clients_round_robin(num_clients, clients):
  family = _two_architectures() + (models.MLP(3, hidden=(2, 5)),)
  het = algorithms.heterogeneous(lambda m: algorithms.fedavg(m, optax.sgd(0.1)), family)
  dealt = groups.as_groups(het, family[0], num_clients)
  assert [index.tolist() for index in dealt.clients] == clients
  assert dealt.models == family[:len(clients)]
  assert dealt.members == het.architectures.members[:len(clients)]
  for i in range(num_clients):
    g, j = dealt.position(i)
    assert clients[g][j] == i
  plain = groups.as_groups(algorithms.fedavg(family[0], optax.sgd(0.1)), family[0], 5)
  assert [index.tolist() for index in plain.clients] == [list(range(5))]
  assert plain.position(3) == (0, 3)


@pytest.mark.slow
def test_heterogeneous_fedavg_runs_as_fedper():
  # The wrapper works around any algorithm that shares a head: FedAvg of the
  # output layer with every feature extractor local.
  config = dataclasses.replace(CONFIG, clients=8, rounds=2, heterogeneous=True)
  record = simulate.run("fedavg", config, 0)
  assert record.summary().best > 0.0
  norms = np.asarray(record.output_norms)
  np.testing.assert_allclose(norms, np.broadcast_to(norms[0], norms.shape), rtol=1e-5)


def test_faulty_clients_draw_is_a_function_of_client_ids():
  took_part = jnp.array([True, False, True, True, False, True])
  key = prng.key(5)
  faulty = faults_lib.faulty_clients(key, took_part, 2)
  assert int(faulty.sum()) == 2 and not (faulty & ~took_part).any()
  more = faults_lib.faulty_clients(key, jnp.concatenate([took_part, jnp.zeros(2, bool)]), 2)
  np.testing.assert_array_equal(more[:6], faulty)  # padding changes nothing


def test_checkpoint_of_another_configuration_is_refused(setup, tmp_path):
  simulate.run("fedavg", CONFIG, 0, setup=setup, checkpoint_dir=str(tmp_path),
               checkpoint_every=1)
  other = dataclasses.replace(CONFIG, lr=0.01, batch_size=5)
  with pytest.raises(ValueError, match="another experiment: batch_size, lr differ"):
    simulate.run("fedavg", other, 0, setup=setup, checkpoint_dir=str(tmp_path),
                 resume=True)
