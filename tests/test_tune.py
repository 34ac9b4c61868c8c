"""Differentiable rounds (`pflax.tune`): hypergradients against central finite
differences in float64, independence of the client mapping, equality with the
engine's rounds, memory that grows with the carry only, and the tuner's record."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pflax import models
from pflax import simulate
from pflax import tune
from pflax._src.cli import main as cli
from pflax._src.simulation import engine

ROUNDS = 2
CONFIG = simulate.ExperimentConfig(
    clients=4, rounds=ROUNDS, local_epochs=1, batch_size=10, strategy="vmap",
    partition="dirichlet", dirichlet_alpha=0.5, samples_per_client=40)
MODEL = models.MLP(10, hidden=(16,))

# Every keyword of `tune.DIFFERENTIABLE` of these algorithms is checked
# (FedClassAvg with Adam, its default optimizer, without its warm-up). FedProx's
# check runs by default; the others (10-17 s each on two cores) in the slow pass.
CHECKED = ("fedprox", *(pytest.param(name, marks=pytest.mark.slow) for name in (
    "cwfedavg", "feddwa", "fedrema", "fedclassavg")))
NO_WARMUP = {"fedclassavg": {"warmup_epochs": 0}}


@pytest.fixture(scope="module")
def setup():
  return simulate.prepare(CONFIG, 0, model=MODEL)


def _task(setup, name, keys=None, **overrides):
  config = dataclasses.replace(CONFIG, hyperparameters=NO_WARMUP, **overrides)
  return tune.make_task(name, config, keys or tune.DIFFERENTIABLE[name], setup=setup,
                        dtype=jnp.float64, chunk_size=3)


def _loss(task, values, seed=0):
  return tune.validation_loss(task, values, seed=seed, rounds=ROUNDS).loss


@pytest.mark.parametrize("name", CHECKED)
def test_hypergradient_matches_central_differences(setup, name):
  with jax.enable_x64(True):
    task = _task(setup, name)
    values = {k: jnp.float64(v) for k, v in task.defaults.items()}
    loss = jax.jit(functools.partial(_loss, task))
    grads = jax.jit(jax.grad(functools.partial(_loss, task)))(values)
    for key in task.keys:
      h = 1e-4 * values[key]
      fd = (loss({**values, key: values[key] + h})
            - loss({**values, key: values[key] - h})) / (2 * h)
      assert grads[key].dtype == jnp.float64
      assert abs(float(fd)) > 1e-7, (key, fd)   # not trivially zero
      np.testing.assert_allclose(float(grads[key]), float(fd), rtol=5e-5, err_msg=key)


@pytest.mark.slow  # 22-26 s on two cores
def test_result_does_not_depend_on_the_client_mapping(setup):
  with jax.enable_x64(True):
    by_strategy = {}
    for strategy in ("vmap", "map"):
      task = _task(setup, "feddwa", strategy=strategy)  # map: chunks of 3 and 1
      values = {k: jnp.float64(v) for k, v in task.defaults.items()}
      out, grads = jax.jit(jax.value_and_grad(
          lambda v, t=task: tune.validation_loss(t, v, seed=1, rounds=ROUNDS).loss))(
              values)
      by_strategy[strategy] = (out, grads)
    (a, ga), (b, gb) = by_strategy["vmap"], by_strategy["map"]
    np.testing.assert_allclose(a, b, rtol=1e-12)
    for key in ga:
      np.testing.assert_allclose(ga[key], gb[key], rtol=1e-9, err_msg=key)


def test_rounds_equal_the_engines(setup):
  """Same federation, seed and values: the engine's programs reach the same state
  (participants, shuffles and server keys follow the same keys)."""
  task = tune.make_task("cwfedavg", dataclasses.replace(CONFIG, participation=0.75),
                        ["wdr_coef"], setup=setup)
  out = tune.validation_loss(task, seed=3, rounds=ROUNDS)
  programs = engine.programs(task.plan)
  one_run = lambda tree: jax.tree.map(lambda x: jnp.asarray(x)[None], tree)
  fed, values, seeds = one_run(task.federation), np.zeros(1, np.float32), np.array([3])
  carry = programs.init(values, (fed,), fed.counts, seeds)
  took_part = []
  for t in range(ROUNDS):
    carry, metrics = programs.round(values, carry, (fed,), seeds, np.int32(t))
    took_part.append(np.asarray(metrics.took_part[0]))
  assert not all(p.all() for p in took_part)   # partial participation was exercised
  chex_close = lambda x, y: np.testing.assert_allclose(x[0], y, rtol=1e-5, atol=1e-6)
  jax.tree.map(chex_close, carry, out.carry)


def test_fedrema_temperature_has_a_zero_gradient(setup):
  """Why it is refused: it acts only through the MDS selection (booleans)."""
  task = tune.make_task("fedrema", CONFIG, ["lr"], setup=setup)
  task = dataclasses.replace(task, keys=("temperature",), defaults={"temperature": 0.5})
  grad = jax.grad(lambda v: _loss(task, v))({"temperature": jnp.float32(0.5)})
  assert float(grad["temperature"]) == 0.0


@pytest.mark.parametrize("name, key, message", [
    ("fedrema", "temperature", "MDS selection"),
    ("fedrema", "delta", "CCP"),
    ("fedsa", "cv_threshold", "threshold"),
    ("fedavg", "max_share", "cap"),
    ("fedprox", "mue", "not a float keyword"),
])
def test_non_differentiable_keywords_are_refused(name, key, message):
  with pytest.raises(ValueError, match=f"'{key}' of {name} is not differentiable "
                     f"\\(.*{message}.*\\); the differentiable keywords of {name} are"):
    tune.check_keys(name, [key])


def test_a_warmup_phase_is_refused(setup):
  with pytest.raises(ValueError, match="warm-up phase.*warmup_epochs=0"):
    tune.make_task("fedclassavg", CONFIG, ["rho"], setup=setup)


def test_a_run_continues_from_its_carry(setup):
  """Two rounds equal one round and one more from its carry (`start`,
  `first_round`): the rounds' keys follow the round numbers."""
  task = tune.make_task("feddwa", CONFIG, ["alpha"], setup=setup)
  both = tune.validation_loss(task, seed=2, rounds=2)
  first = tune.validation_loss(task, seed=2, rounds=1)
  second = tune.validation_loss(task, seed=2, rounds=1, start=first.carry,
                                first_round=1)
  np.testing.assert_allclose(second.losses, both.losses, rtol=1e-5)
  np.testing.assert_array_equal(second.correct, both.correct)
  np.testing.assert_allclose(second.train_losses[0], both.train_losses[1], rtol=1e-5)


def test_loop_strategy_is_refused(setup):
  with pytest.raises(ValueError, match="strategy 'loop'.*cannot trace.*'vmap' or 'map'"):
    tune.make_task("fedprox", dataclasses.replace(CONFIG, strategy="loop"), ["mu"],
                   setup=setup)


def test_validation_is_held_out_of_the_training_split(setup):
  fed = setup.federation
  train, val = tune.hold_out(fed, 0.25, seed=0, batch_size=CONFIG.batch_size)
  assert np.array_equal(train.num_samples + val.mask.sum(1), fed.num_samples)
  assert (val.mask.sum(1) > 0).all() and (train.num_samples > 0).all()
  np.testing.assert_array_equal(train.counts.sum(1), train.num_samples)
  for kept in ("test_x", "test_y", "test_mask"):     # the test split is untouched
    np.testing.assert_array_equal(getattr(train, kept), getattr(fed, kept))
  for i in range(CONFIG.clients):                     # each sample on one side only
    rows = lambda x, v: {r.tobytes() for r in x[i][v[i]]}
    both = rows(train.x, train.mask) | rows(val.x, val.mask)
    assert len(both) == len(rows(fed.x, fed.mask))


def test_memory_grows_with_the_carry_not_with_the_rounds(setup):
  config = dataclasses.replace(CONFIG, local_epochs=2)
  task = tune.make_task("fedprox", config, ["mu"], setup=setup)
  values = {"mu": jnp.float32(0.01)}

  def temp_bytes(rounds):
    grad = jax.jit(jax.grad(lambda v: tune.validation_loss(
        task, v, seed=0, rounds=rounds).loss))
    return grad.lower(values).compile().memory_analysis().temp_size_in_bytes

  carry = jax.eval_shape(lambda: tune.initial_carry(task, seed=0))
  carry_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(carry))
  params = carry_bytes  # FedProx's carry is one global model (SGD has no state)
  steps = config.local_epochs * -(-int(task.federation.num_samples.max())
                                  // config.batch_size)
  one_round_of_steps = CONFIG.clients * steps * params
  per_round = (temp_bytes(8) - temp_bytes(4)) / 4
  assert per_round <= 2 * carry_bytes + 1024, (per_round, carry_bytes)
  assert per_round < one_round_of_steps / 4, (per_round, one_round_of_steps)


def test_parametrizations_invert():
  for kind, value in (("log", 0.03), ("logit", 0.2), ("identity", -1.5)):
    u = tune.to_unconstrained(value, kind)
    np.testing.assert_allclose(tune.from_unconstrained(u, kind), value, rtol=1e-6)
  assert tune.parametrization("alpha") == "logit" and tune.parametrization("mu") == "log"


def test_tune_records_a_path_that_saves_and_plots(setup, tmp_path):
  task = tune.make_task("fedprox", CONFIG, ["mu", "lr"], setup=setup)
  seen = []
  record = tune.tune(task, steps=2, seed=0, optimizer=optax.sgd(0.5),
                     optimizer_label="sgd(0.5)", values={"mu": 0.01},
                     on_step=seen.append)
  assert [p.step for p in record.path] == [0, 1, 2] and list(record.path) == seen
  first, second = record.path[:2]
  assert first.values == pytest.approx({"mu": 0.01, "lr": CONFIG.lr}, rel=1e-6)
  for key, kind in (("mu", "log"), ("lr", "log")):
    assert record.parametrizations[key] == kind
    # one SGD step on log(value): log v' = log v - 0.5 * v * dL/dv
    expected = first.values[key] * np.exp(-0.5 * first.values[key]
                                          * first.gradient[key])
    assert second.values[key] == pytest.approx(expected, rel=1e-4)
  assert all(0.0 <= p.test_accuracy <= 1.0 and np.isfinite(p.validation_loss)
             for p in record.path)
  path = tmp_path / "tune.json"
  record.save(str(path))
  assert tune.TuneRecord.load(str(path)) == record
  assert json.loads(path.read_text())["config"]["clients"] == CONFIG.clients
  record.plot(str(tmp_path / "tune.png"))
  assert (tmp_path / "tune.png").stat().st_size > 0


def test_tune_refuses_a_start_outside_the_parametrization(setup):
  task = tune.make_task("fedprox", CONFIG, ["mu"], setup=setup)
  with pytest.raises(ValueError, match="mu starts at 0.0.*log parametrization.*> 0"):
    tune.tune(task, steps=1, seed=0, values={"mu": 0.0})
  with pytest.raises(ValueError, match="'lr' is not a key of the task"):
    tune.validation_loss(task, {"lr": 0.1}, seed=0, rounds=1)


TINY_RUN = ["--clients", "4", "--rounds", "1", "--local-epochs", "1", "--model", "mlp",
            "--samples-per-client", "60", "--strategy", "vmap", "--no-progress",
            "--no-compilation-cache"]


def test_cli_tune_writes_the_record_and_a_table(tmp_path, capsys):
  out = tmp_path / "out"
  code = cli.main(["--algorithms", "fedavg", "--tune", "lr", "--tune-steps", "2",
                   "--out", str(out), *TINY_RUN])
  assert code == 0
  printed = capsys.readouterr().out
  record = tune.TuneRecord.load(str(out / "tune_fedavg.json"))
  assert record.keys == ("lr",) and len(record.path) == 3
  assert record.path[0].values["lr"] == pytest.approx(0.05)
  assert record.optimizer == "adam(0.1)" and record.config["clients"] == 4
  assert (out / "tune_fedavg.png").stat().st_size > 0
  assert "| algorithm | start | best (step) |" in printed
  assert "| fedavg | lr=0.05 | lr=" in printed
  assert not (out / "results.json").exists()


@pytest.mark.parametrize("flags, message", [
    (["--sweep", "lr", "--values", "0.1"], "--tune cannot be combined with --sweep"),
    (["--flower"], "--tune cannot be combined with --flower"),
    (["--distributed"], "--tune cannot be combined with --distributed"),
    (["--devices", "1"], "--tune cannot be combined with --devices"),
    (["--checkpoint-every", "1"], "--tune cannot be combined with --checkpoint-every"),
    (["--resume"], "--tune cannot be combined with --resume"),
    (["--heterogeneous"], "--tune cannot be combined with --heterogeneous"),
    (["--strategy", "loop"], "--tune needs --strategy vmap, map or auto"),
    (["--seeds", "0", "1"], "--tune tunes with one seed, got --seeds 0 1"),
    (["--tune-steps", "-1"], r"--tune-steps must be in \[0, "),
    (["--tune-lr", "0"], r"--tune-lr must be in \(0, "),
    (["--tune-validation", "1"], r"--tune-validation must be in \(0, 1\)"),
    (["--algorithms", "fedavg", "fedrema", "--tune", "temperature"],
     "--tune: 'temperature' of fedavg is not differentiable"),
    (["--algorithms", "fedrema", "--tune", "temperature"],
     r"--tune: 'temperature' of fedrema is not differentiable \(.*MDS"),
])
def test_cli_tune_refusals_are_one_line_errors_before_any_work(flags, message,
                                                               tmp_path):
  base = ["--algorithms", "fedavg", "--tune", "lr"]
  with pytest.raises(SystemExit, match="^pflax-run: " + message) as error:
    cli.main(base + flags + ["--out", str(tmp_path / "out")])
  assert "\n" not in str(error.value)
  assert not (tmp_path / "out").exists()
