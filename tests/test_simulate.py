"""End-to-end simulation: all algorithms, determinism, resume, faulty clients, CLI."""

import dataclasses
import json
import logging
import os
import time

import jax
import numpy as np
import pytest

from pflax import algorithms
from pflax import simulate
from pflax._src.cli import main as cli
from pflax._src.core import prng
from pflax._src.methods.algorithm import EVALUATED
from pflax._src.simulation import keys as keys_lib
from pflax._src.simulation.records import FINAL_WINDOW

CONFIG = simulate.ExperimentConfig(clients=6, rounds=3, model="mlp", eval_every=1,
                                   local_epochs=1)
NAMES = tuple(algorithms.METHODS)


@pytest.fixture(scope="module")
def setup():
  return simulate.prepare(CONFIG, seed=0)


def _without_time(record):
  return {k: v for k, v in record.to_json().items() if k != "seconds"}


@pytest.mark.parametrize("name", NAMES)
def test_every_algorithm_runs_and_reports(setup, name):
  run = simulate.run(name, CONFIG, 0, setup=setup)
  record = run.to_json()
  assert run.algorithm == name and run.seed == 0
  assert [h.round for h in run.history] == [1, 2, 3]
  for h in run.history:
    assert 0.0 <= h.accuracy() <= 1.0
    assert np.isfinite(h.train_loss)
    assert h.dropped_clients == ()
  acc = record["personalized_accuracy"]
  assert acc["best"] >= acc["final"] - 1e-12
  # FedClassAvg's global model is the averaged classifier on each client's own
  # features; FedDWA's exclusive models are no global model (issue 11, 7 and 16).
  kinds = {"personalized"} | {"fedavg": {"global"}, "fedprox": {"global"},
                              "fedsa": {"global"}, "fedclassavg": {"global"},
                              "feddwa": {"exclusive"}, "ditto": {"global"},
                              "fedavg_ft": {"global"},
                              "fedbabu": {"global"}, "apfl": {"global"},
                              "moon": {"global"}, "fedala": {"global"}}.get(name, set())
  for kind in EVALUATED:
    summary = record[f"{kind}_accuracy"]
    assert (summary is not None) == (kind in kinds)
    assert all((f"{kind}_accuracy" in h) == (kind in kinds) for h in record["history"])
    if summary is not None:
      # Unweighted mean and std over clients (issue 11, 13), final window as `final`.
      final = record["history"][-FINAL_WINDOW:]
      for key in ("client_mean", "client_std"):
        assert summary[key] == pytest.approx(np.mean([h[f"{kind}_{key}"] for h in final]))
      assert all(0.0 <= h[f"{kind}_client_mean"] <= 1.0 and h[f"{kind}_client_std"] >= 0.0
                 for h in record["history"])
  assert np.asarray(record["output_norms"]).shape == (6, 10)


def test_final_accuracy_is_the_mean_of_the_last_evaluations_not_rounds():
  # eval_every=2 over 12 rounds: evaluations at rounds 2, 4, .., 12 (accuracy
  # t / 100); the last FINAL_WINDOW = 5 of them are rounds 4 to 12.
  def record(t):
    accuracies = ({"personalized": simulate.Accuracy(t / 100, t / 100, 0.0)}
                  if t % 2 == 0 else {})
    return simulate.RoundRecord(t, 0.0, accuracies=accuracies)
  history = [record(t) for t in range(1, 13)]
  summary = simulate.Summary.of("personalized", history)
  assert summary.final == pytest.approx(np.mean([0.04, 0.06, 0.08, 0.10, 0.12]))
  assert summary.best == 0.12


def test_training_improves_over_chance(setup):
  config = dataclasses.replace(CONFIG, rounds=8)
  record = simulate.run("local", config, 0, setup=setup)
  assert record.summary().best > 0.5  # 2 classes per client


def test_same_seed_same_results_and_no_recompilation(setup, caplog):
  compiles_after_round_2 = []

  def on_round(record):
    if record.round >= 2:
      compiles_after_round_2.extend(
          r for r in caplog.records if "Compiling" in r.getMessage())
    caplog.clear()

  with jax.log_compiles(True), caplog.at_level(logging.WARNING):
    first = simulate.run("fedrema", CONFIG, 1, setup=setup, on_round=on_round)
  assert not compiles_after_round_2, [r.getMessage()[:120] for r in
                                      compiles_after_round_2]
  second = simulate.run("fedrema", CONFIG, 1, setup=setup)
  assert _without_time(first) == _without_time(second)
  other = simulate.run("fedrema", CONFIG, 2, setup=setup)
  assert _without_time(first) != _without_time(other)


class _Killed(Exception):
  pass


SLOW_ROUND_SECONDS = 1.5


@pytest.mark.parametrize(
    "name", ["cwfedavg", pytest.param("fedrema", marks=pytest.mark.slow)])
def test_resume_after_kill_equals_uninterrupted(setup, tmp_path, name):
  config = dataclasses.replace(CONFIG, rounds=4)
  uninterrupted = simulate.run(name, config, 0, setup=setup)

  def slow_round_1_then_kill_at_round_3(record):
    if record.round == 1:
      time.sleep(SLOW_ROUND_SECONDS)
    if record.round == 3:
      raise _Killed

  with pytest.raises(_Killed):
    simulate.run(name, config, 0, setup=setup,
                 on_round=slow_round_1_then_kill_at_round_3,
                 checkpoint_dir=str(tmp_path), checkpoint_every=2)
  resumed = simulate.run(name, config, 0, setup=setup,
                         checkpoint_dir=str(tmp_path), resume=True)
  assert _without_time(resumed) == _without_time(uninterrupted)
  # `seconds` covers the whole run: the rounds before the checkpoint included.
  assert resumed.seconds >= SLOW_ROUND_SECONDS


def test_non_finite_client_is_dropped_and_others_continue(setup):
  fed = setup.federation
  x = fed.x.copy()
  x[2] = np.nan
  bad = dataclasses.replace(setup, federation=fed._replace(x=x))
  record = simulate.run("fedavg", CONFIG, 0, setup=bad)
  assert all(h.dropped_clients == (2,) for h in record.history)
  assert all(np.isfinite(h.accuracy()) for h in record.history)
  assert record.summary().best > 0.0


def test_partial_participation_samples_a_fixed_number():
  chosen = [keys_lib.participants(prng.key(s), 10, 0.3) for s in range(5)]
  assert all(c.shape == (3,) for c in chosen)
  assert all(np.all(np.diff(np.asarray(c)) > 0) for c in chosen)
  assert len({tuple(np.asarray(c)) for c in chosen}) > 1


def test_partial_participation_leaves_absent_clients_unchanged(setup):
  # Every round trains 2 of the 6 local models: the others are never touched.
  config = dataclasses.replace(CONFIG, participation=1 / 3, rounds=1)
  sample_key = keys_lib.round_keys(keys_lib.run_keys(0)[2], 0)[0]
  chosen = np.asarray(keys_lib.participants(jax.random.fold_in(sample_key, 0), 6, 1 / 3))
  record = simulate.run("local", config, 0, setup=setup)
  untouched = simulate.run("local", dataclasses.replace(config, lr=1e-30), 0,
                           setup=setup)
  moved = ~np.isclose(record.output_norms, untouched.output_norms).all(axis=1)
  assert sorted(np.flatnonzero(moved)) == sorted(chosen.tolist())


def _every_participant_faulty(config):
  """`config` with every participant uploading NaN (faults asked for, so empty
  rounds are allowed): each round's dropped clients are exactly its participants."""
  return dataclasses.replace(config, faulty_clients=0.99, fault_kind="nan")


def test_partial_participation_draws_new_participants_every_round(setup):
  config = dataclasses.replace(CONFIG, participation=1 / 3, rounds=3)
  record = simulate.run("local", _every_participant_faulty(config), 0, setup=setup)
  drawn = [h.dropped_clients for h in record.history]
  assert [len(d) for d in drawn] == [2, 2, 2]
  assert len(set(drawn)) > 1, drawn


def test_a_client_trains_alike_whoever_else_takes_part(setup):
  # Round 1 of a run with 2 of 6 clients: each participant trains exactly as in
  # round 1 with every client (its key is a function of its id, not of its
  # position among the participants).
  config = dataclasses.replace(CONFIG, participation=1 / 3, rounds=1)
  chosen = list(simulate.run("local", _every_participant_faulty(config), 0,
                             setup=setup).history[0].dropped_clients)
  assert chosen != [0, 1]  # else positions and ids coincide
  partial = simulate.run("local", config, 0, setup=setup)
  full = simulate.run("local", dataclasses.replace(config, participation=1.0), 0,
                      setup=setup)
  np.testing.assert_allclose(partial.output_norms[chosen], full.output_norms[chosen],
                             rtol=1e-6)
  assert not np.allclose(partial.output_norms, full.output_norms)


def test_cli_writes_results_and_plots(tmp_path):
  out = str(tmp_path / "run")
  code = cli.main(["--algorithms", "fedavg", "local", "--clients", "6", "--rounds", "2",
                   "--model", "mlp", "--out", out, "--no-progress"])
  assert code == 0
  with open(os.path.join(out, "results.json")) as f:
    results = json.load(f)
  assert results["config"]["clients"] == 6
  assert [r["algorithm"] for r in results["runs"]] == ["fedavg", "local"]
  for run in results["runs"]:
    assert set(run) >= {"algorithm", "seed", "personalized_accuracy", "global_accuracy",
                        "history", "seconds"}
    assert set(run["history"][0]) >= {"round", "personalized_accuracy", "train_loss"}
  for name in ("accuracy.png", "output_norms.png"):
    with open(os.path.join(out, name), "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_cli_runs_seeds_and_a_grid_as_one_sweep(tmp_path):
  out = str(tmp_path / "sweep")
  code = cli.main(["--algorithms", "fedavg", "--clients", "6", "--rounds", "2",
                   "--model", "mlp", "--local-epochs", "1", "--seeds", "0", "1",
                   "--sweep", "lr", "--values", "0.01", "0.1", "--out", out,
                   "--no-progress"])
  assert code == 0
  with open(os.path.join(out, "results.json")) as f:
    results = json.load(f)
  assert results["config"]["sweep"] == {"lr": [0.01, 0.1]}
  assert [(r["hyperparameter"]["lr"], r["seed"]) for r in results["runs"]] == [
      (0.01, 0), (0.01, 1), (0.1, 0), (0.1, 1)]


def test_cli_rejects_a_grid_run_sequentially(tmp_path):
  with pytest.raises(SystemExit, match="--sweep and --devices run as one sweep"):
    cli.main(["--sweep", "lr", "--values", "0.1", "--sequential",
              "--out", str(tmp_path)])


def test_cli_rejects_devices_with_the_loop_strategy(tmp_path):
  with pytest.raises(SystemExit, match="--devices runs each round as one program"):
    cli.main(["--devices", "1", "--strategy", "loop", "--out", str(tmp_path)])


@pytest.mark.slow
def test_heterogeneous_fedclassavg_shares_only_the_classifier(setup):
  config = dataclasses.replace(CONFIG, clients=8, rounds=2, heterogeneous=True)
  het_setup = simulate.prepare(config, 0)
  record = simulate.run("fedclassavg", config, 0, setup=het_setup)
  assert all(h.dropped_clients == () for h in record.history)
  assert 0.0 <= record.summary().best <= 1.0
  assert 0.0 <= record.summary("global").best <= 1.0
  # The norms are of each client's own classifier (issue 11, 7): they differ.
  norms = np.asarray(record.output_norms)
  assert norms.shape == (8, 10) and not np.allclose(norms, norms[0])


@pytest.mark.slow
def test_heterogeneous_participants_are_round_p_m_of_all_clients():
  # Issue 11, 10: p = 0.25 of 8 clients in four architecture groups of 2 is 2
  # clients (per group, max(1, round(0.5)) drew 4). Every participant uploads NaN,
  # so the dropped clients are exactly the participants.
  config = dataclasses.replace(CONFIG, clients=8, rounds=2, heterogeneous=True,
                               participation=0.25)
  record = simulate.run("fedclassavg", _every_participant_faulty(config), 0,
                        setup=simulate.prepare(config, 0))
  assert [len(h.dropped_clients) for h in record.history] == [2, 2]


def test_heterogeneous_needs_an_algorithm_that_shares_a_head(setup):
  config = dataclasses.replace(CONFIG, heterogeneous=True)
  with pytest.raises(ValueError, match="heterogeneous models need an algorithm that "
                                       "shares a head"):
    simulate.run("fedrema", config, 0, setup=setup)
