"""Any JAX model (issue 31): Flax NNX, Equinox and a pair of functions train
every algorithm, find or declare their parts, equal a linen model with the same
parameters, resume, tune, and are refused with messages naming the problem."""

import dataclasses
import sys

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from pflax import algorithms
from pflax import data
from pflax import models
from pflax import simulate
from pflax import tree
from pflax import tune
from pflax._src.simulation import experiment as experiment_lib

import user_models  # pylint: disable=wrong-import-position

ALGORITHMS = tuple(algorithms.METHODS)
FAST = ("fedavg", "fedclassavg")

CONFIG = simulate.ExperimentConfig(clients=4, rounds=2, local_epochs=1,
                                   partition="dirichlet", dirichlet_alpha=1.0,
                                   strategy="vmap")


class NNXMLP(nnx.Module):
  """The issue's NNX MLP on 8x8 digits."""

  def __init__(self, rngs: nnx.Rngs):
    self.l1 = nnx.Linear(64, 16, rngs=rngs)
    self.l2 = nnx.Linear(16, 10, rngs=rngs)

  def __call__(self, x):
    return self.l2(nnx.relu(self.l1(x.reshape(x.shape[0], -1))))


def nnx_cnn(rngs: nnx.Rngs) -> nnx.Sequential:
  """An NNX CNN with Flax's default names: `layers/0` .. `layers/5`."""
  return nnx.Sequential(
      nnx.Conv(1, 4, (3, 3), rngs=rngs), nnx.relu,
      lambda x: x.reshape(x.shape[0], -1),
      nnx.Linear(256, 16, rngs=rngs), nnx.relu, nnx.Linear(16, 10, rngs=rngs))


class EqxMLP(eqx.Module):
  """An Equinox MLP: acts on one example, as Equinox layers do."""
  mlp: eqx.nn.MLP

  def __init__(self, key):
    self.mlp = eqx.nn.MLP(64, 10, 16, 1, key=key)

  def __call__(self, x):
    return self.mlp(x.reshape(-1))


@pytest.fixture(scope="module", name="digits")
def _digits():
  full = data.load_digits()
  return full._replace(images=full.images[:300], labels=full.labels[:300])


def _check(run):
  assert len(run.history) == 2
  assert np.isfinite(run.summary().final)
  norms = np.asarray(run.output_norms)
  assert norms.shape == (CONFIG.clients, 10) and np.all(norms > 0)


MODELS = {"nnx-mlp": NNXMLP, "nnx-cnn": nnx_cnn, "eqx-mlp": EqxMLP}


@pytest.mark.parametrize("algorithm", FAST)
def test_an_nnx_model_trains(algorithm, digits):
  _check(simulate.run(algorithm, CONFIG, 0, dataset=digits, model=NNXMLP))


@pytest.mark.parametrize("algorithm", ("fedavg",))
def test_an_equinox_model_trains(algorithm, digits):
  _check(simulate.run(algorithm, CONFIG, 0, dataset=digits, model=EqxMLP))


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("kind", tuple(MODELS))
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_trains_every_kind(algorithm, kind, digits):
  _check(simulate.run(algorithm, CONFIG, 0, dataset=digits, model=MODELS[kind]))


def test_the_last_linear_layer_called_is_the_output():
  assert models.model_parts(NNXMLP, (8, 8, 1), 10).output == tree.under("l2")
  assert models.model_parts(nnx_cnn, (8, 8, 1), 10).output == tree.under("layers", "5")
  assert models.model_parts(EqxMLP, (8, 8, 1), 10).output == tree.under(
      "mlp", "layers", "1")


def test_parameters_are_plain_dicts_keyed_by_attribute_path():
  key, x = jax.random.key(0), jnp.ones((2, 8, 8, 1))
  nnx_params = models.as_model(nnx_cnn).init(key, x)["params"]
  assert sorted(nnx_params["layers"]) == ["0", "3", "5"]
  assert nnx_params["layers"]["5"]["kernel"].shape == (16, 10)
  eqx_params = models.as_model(EqxMLP).init(key, x)["params"]
  # an eqx.nn.Linear's weight (K, D) reads as Flax's kernel (D, K)
  assert eqx_params["mlp"]["layers"]["1"]["kernel"].shape == (16, 10)
  model = EqxMLP(key)
  adapted = models.as_model(model)
  np.testing.assert_array_equal(adapted.apply(adapted.init(key, x), x),
                                jax.vmap(model)(x))


def test_a_constructor_gives_each_seed_its_parameters_an_instance_its_own():
  x = jnp.ones((1, 8, 8, 1))
  for constructor in (NNXMLP, EqxMLP):
    model = models.as_model(constructor)
    first, second = (model.init(jax.random.key(s), x)["params"] for s in (0, 1))
    assert not np.allclose(jax.tree.leaves(first)[1], jax.tree.leaves(second)[1])
  instance = models.as_model(NNXMLP(nnx.Rngs(3)))
  first, second = (instance.init(jax.random.key(s), x)["params"] for s in (0, 1))
  jax.tree.map(np.testing.assert_array_equal, first, second)


def _constant(value):
  return lambda *_: jnp.asarray(value)


class LinenTwin(nn.Module):
  """A linen MLP whose parameters are given arrays (so that it starts where
  the NNX twin does whatever the key)."""
  start: tuple

  @nn.compact
  def __call__(self, x):
    (b0, k0), (b1, k1) = self.start
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(16, kernel_init=_constant(k0), bias_init=_constant(b0),
                         name="l1")(x))
    return nn.Dense(10, kernel_init=_constant(k1), bias_init=_constant(b1),
                    name="l2")(x)


@pytest.mark.parametrize("algorithm", (
    "fedavg", "cwfedavg", pytest.param("fedrema", marks=pytest.mark.slow),
    pytest.param("ditto", marks=pytest.mark.slow)))
def test_linen_and_nnx_models_with_the_same_parameters_give_the_same_run(
    algorithm, digits):
  twin = NNXMLP(nnx.Rngs(7))
  start = tuple((np.asarray(layer.bias[...]), np.asarray(layer.kernel[...]))
                for layer in (twin.l1, twin.l2))
  linen, nnx_run = (simulate.run(algorithm, CONFIG, 0, dataset=digits, model=m).to_json()
                    for m in (LinenTwin(start), twin))
  del linen["seconds"], nnx_run["seconds"]
  assert jax.tree.structure(linen) == jax.tree.structure(nnx_run)
  for a, b in zip(jax.tree.leaves(linen), jax.tree.leaves(nnx_run)):
    assert a == (pytest.approx(b, rel=1e-5, abs=1e-6) if isinstance(a, float) else b)


class _Killed(Exception):
  pass


def test_a_resumed_nnx_run_equals_an_uninterrupted_one(digits, tmp_path):
  def kill_at_round_2(record):
    if record.round == 2:
      raise _Killed

  with pytest.raises(_Killed):
    simulate.run("cwfedavg", CONFIG, 0, dataset=digits, model=NNXMLP,
                 on_round=kill_at_round_2, checkpoint_dir=str(tmp_path),
                 checkpoint_every=1)
  rounds = []
  resumed = simulate.run("cwfedavg", CONFIG, 0, dataset=digits, model=NNXMLP,
                         checkpoint_dir=str(tmp_path), checkpoint_every=1, resume=True,
                         on_round=lambda record: rounds.append(record.round))
  whole = simulate.run("cwfedavg", CONFIG, 0, dataset=digits, model=NNXMLP)
  assert rounds == [2]
  drop = lambda run: {k: v for k, v in run.to_json().items() if k != "seconds"}
  assert drop(resumed) == drop(whole)


FLOWER_CONFIG = simulate.ExperimentConfig(clients=4, rounds=2, local_epochs=1,
                                          samples_per_client=40)


def _same_run(federated, simulated):
  """The same rounds (accuracies of every kind, dropped clients), training losses
  to float rounding (the server sums them in float64) and output norms."""
  assert len(federated.history) == len(simulated.history)
  for a, b in zip(federated.history, simulated.history):
    assert (a.round, a.accuracies, a.dropped_clients) == (
        b.round, b.accuracies, b.dropped_clients)
    np.testing.assert_allclose(a.train_loss, b.train_loss, rtol=1e-5)
  np.testing.assert_allclose(federated.output_norms, simulated.output_norms, rtol=1e-5)


@pytest.mark.parametrize("algorithm", (
    "fedavg", pytest.param("cwfedavg", marks=pytest.mark.slow)))
def test_an_nnx_model_in_a_flower_federation_equals_the_simulation(algorithm):
  """The server's records read the NNX model's own output layer (`l2`)."""
  flower = pytest.importorskip("pflax.flower")
  federated = flower.run_in_process(flower.Experiment(algorithm, FLOWER_CONFIG, 3,
                                                      model=NNXMLP))
  _same_run(federated.results().runs[0],
            simulate.run(algorithm, FLOWER_CONFIG, 3, model=NNXMLP))


def test_a_deployed_federation_imports_the_model_from_its_import_string(
    tmp_path, monkeypatch):
  """`Experiment(model="module:attr")` travels as JSON; every process imports
  it from `PFLAX_BUILDER_PATH` (as `pflax-run --flower` sets it)."""
  flower = pytest.importorskip("pflax.flower")
  (tmp_path / "pflax_test_user_models.py").write_text(user_models.NNX_NET_SOURCE)
  monkeypatch.setattr(sys, "path", list(sys.path))
  monkeypatch.setenv("PFLAX_BUILDER_PATH", str(tmp_path))
  experiment = flower.Experiment("fedavg", FLOWER_CONFIG, 0,
                                 model="pflax_test_user_models:Net")
  flower.write_run_config(str(tmp_path / "run.toml"), experiment)
  received = flower.Experiment.from_json(experiment.to_json())
  assert received == experiment
  groups, parts = received.build((8, 8, 1), 10)
  assert models.as_model(groups.models[0]).kind == "nnx"
  assert parts.output == tree.under("head")


def test_a_model_given_in_code_is_refused_where_it_cannot_travel(tmp_path):
  flower = pytest.importorskip("pflax.flower")
  experiment = flower.Experiment("fedavg", FLOWER_CONFIG, 0, model=NNXMLP)
  with pytest.raises(ValueError, match=r"model is a Python object \(NNXMLP\), which "
                     r"cannot travel.*Experiment\(model='module:attr'\)"):
    flower.write_run_config(str(tmp_path / "run.toml"), experiment)
  with pytest.raises(ValueError, match=r"cannot import the model 'no_such_module:Net'"):
    dataclasses.replace(experiment, model="no_such_module:Net").build((8, 8, 1), 10)


@pytest.mark.parametrize("server_model, node_model, message", [
    (NNXMLP, None, r"node 1 failed to register: ValueError: the experiment runs a "
                   r"model given in code \(NNXMLP\).*client_app\(model=\.\.\.\)"),
    (None, NNXMLP, r"node 1 failed to register: ValueError: client_app was given a "
                   r"model, but the server's experiment has none given in code"),
], ids=["node-without-model", "server-without-model"])
def test_a_node_and_a_server_that_disagree_on_the_model_are_refused(
    server_model, node_model, message):
  flower = pytest.importorskip("pflax.flower")
  grid = flower.InProcessGrid(flower.in_process_nodes(
      FLOWER_CONFIG.clients, flower.client_app(model=node_model)))
  with pytest.raises(RuntimeError, match=message):
    flower.run_in_process(flower.Experiment("fedavg", FLOWER_CONFIG, 0,
                                            model=server_model), grid)


class Shallow(nnx.Module):
  """A body of one layer to 16 features, and the `head` of the family."""

  def __init__(self, rngs):
    self.body = nnx.Linear(64, 16, rngs=rngs)
    self.head = nnx.Linear(16, 10, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.body(x.reshape(x.shape[0], -1))))


class Deep(nnx.Module):
  """A body of two layers (another width) to 16 features, and the same `head`."""

  def __init__(self, rngs, head_inputs=16):
    self.body = nnx.Sequential(nnx.Linear(64, 32, rngs=rngs), nnx.relu,
                               nnx.Linear(32, head_inputs, rngs=rngs))
    self.head = nnx.Linear(head_inputs, 10, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.body(x.reshape(x.shape[0], -1))))


def narrow_deep(rngs):
  """`Deep` whose head takes 8 features (not the family's 16)."""
  return Deep(rngs, head_inputs=8)


HETEROGENEOUS = dataclasses.replace(
    CONFIG, heterogeneous=True,
    hyperparameters={"fedclassavg": {"warmup_epochs": 0}})   # one program less


@pytest.mark.slow
def test_heterogeneous_fedclassavg_trains_a_family_of_nnx_models_sharing_the_head(
    digits):
  """Client i trains `[Shallow, Deep][i % 2]`, its contrastive features the
  head's input."""
  _check(simulate.run("fedclassavg", HETEROGENEOUS, 0, dataset=digits,
                      model=[Shallow, Deep]))


def test_a_family_of_nnx_models_shares_only_its_head(digits):
  setup = simulate.prepare(HETEROGENEOUS, 0, dataset=digits, model=[Shallow, Deep])
  assert [adapted.name for adapted, _ in setup.family] == ["Shallow", "Deep"]
  algorithm = experiment_lib.build_algorithm("fedclassavg", HETEROGENEOUS, (8, 8, 1),
                                           10, model=[Shallow, Deep])[0]
  assert algorithm.architectures.shared == tree.under("head")
  assert [m.name for m in algorithm.architectures.models] == ["Shallow", "Deep"]


@pytest.mark.slow
def test_a_family_of_nnx_models_in_a_flower_federation_equals_the_simulation():
  flower = pytest.importorskip("pflax.flower")
  config = dataclasses.replace(FLOWER_CONFIG, heterogeneous=True,
                               hyperparameters=HETEROGENEOUS.hyperparameters)
  federated = flower.run_in_process(flower.Experiment("fedclassavg", config, 2,
                                                      model=[Shallow, Deep]))
  _same_run(federated.results().runs[0],
            simulate.run("fedclassavg", config, 2, model=[Shallow, Deep]))


@pytest.mark.parametrize("model, change, message", [
    ([Shallow, narrow_deep], {},
     r"family must share their output layer \(the same path and shapes\): Shallow "
     r"has pflax.tree.under\('head',\) \{'head/bias': \(10,\), 'head/kernel': "
     r"\(16, 10\)\}, narrow_deep has .*'head/kernel': \(8, 10\)"),
    ([Shallow, NNXMLP], {}, r"family must share their output layer.*NNXMLP has "
                            r"pflax.tree.under\('l2',\)"),
    ([Shallow, Deep], {"heterogeneous": False}, r"model is a list, a family of "
                                                r"architectures: set heterogeneous=True"),
    (NNXMLP, {}, r"heterogeneous=True trains pflax's family .* or yours, a list of "
                 r"models .*it does not train one model of your own \(NNXMLP\)"),
    ([], {}, r"model is an empty list"),
], ids=["head-shapes", "head-paths", "not-heterogeneous", "one-model", "empty"])
def test_a_family_that_does_not_share_its_head_is_refused(model, change, message,
                                                          digits):
  with pytest.raises(ValueError, match=message):
    simulate.run("fedclassavg", dataclasses.replace(HETEROGENEOUS, **change), 0,
                 dataset=digits, model=model)


def test_tune_takes_an_nnx_model(digits):
  config = dataclasses.replace(CONFIG, rounds=1)
  task = tune.make_task("fedprox", config, ["mu"], dataset=digits, model=NNXMLP)
  result = tune.validation_loss(task, {"mu": 0.01}, seed=0, rounds=1)
  assert np.isfinite(result.loss)


def test_a_pair_of_functions_trains_with_its_declared_output(digits):
  def init_fn(key, x):
    k1, k2 = jax.random.split(key)
    d = int(np.prod(x.shape[1:]))
    return {"hidden": {"kernel": jax.random.normal(k1, (d, 16)) * 0.1},
            "out": {"kernel": jax.random.normal(k2, (16, 10)) * 0.1,
                    "bias": jnp.zeros(10)}}

  def apply_fn(params, x):
    h = jax.nn.relu(x.reshape(x.shape[0], -1) @ params["hidden"]["kernel"])
    return h @ params["out"]["kernel"] + params["out"]["bias"]

  with pytest.raises(ValueError, match=r"pair of functions.*declare it.*Parts\(output="):
    simulate.prepare(CONFIG, 0, dataset=digits, model=(init_fn, apply_fn))
  run = simulate.run("cwfedavg", CONFIG, 0, dataset=digits, model=(init_fn, apply_fn),
                     parts=models.Parts(output=tree.under("out")))
  _check(run)


class WithBatchNorm(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(64, 10, rngs=rngs)
    self.norm = nnx.BatchNorm(10, rngs=rngs)

  def __call__(self, x):
    return self.norm(self.l1(x.reshape(x.shape[0], -1)))


class EqxWithBatchNorm(eqx.Module):
  norm: eqx.nn.BatchNorm

  def __init__(self, key):
    del key
    self.norm = eqx.nn.BatchNorm(10, "batch")


class NoLinear(nnx.Module):
  def __init__(self, rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (64, 10)))

  def __call__(self, x):
    return x.reshape(x.shape[0], -1) @ self.w[...]


class ThreeOutputs(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(64, 3, rngs=rngs)

  def __call__(self, x):
    return self.l1(x.reshape(x.shape[0], -1))


class WideInput(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(100, 10, rngs=rngs)

  def __call__(self, x):
    return self.l1(x.reshape(x.shape[0], -1))


class EqxLinear(eqx.Module):
  """One `eqx.nn.Linear` from `inputs` features to `outputs` logits."""
  linear: eqx.nn.Linear

  def __init__(self, key, inputs=64, outputs=10):
    self.linear = eqx.nn.Linear(inputs, outputs, key=key)

  def __call__(self, x):
    return self.linear(x.reshape(-1))


def _linear_pair(inputs: int, outputs: int):
  """A pair of functions: one affine layer from `inputs` to `outputs`."""
  def init_fn(key, x):
    del x
    return {"out": {"kernel": jax.random.normal(key, (inputs, outputs)),
                    "bias": jnp.zeros(outputs)}}

  def apply_linear(params, x):
    return x.reshape(x.shape[0], -1) @ params["out"]["kernel"] + params["out"]["bias"]
  return init_fn, apply_linear


@pytest.mark.parametrize("model, message", [
    ("mlp", r"model must be a flax\.linen\.Module; a flax\.nnx\.Module .* got str"),
    (object(), r"model must be .*or a pair \(init_fn, apply_fn\).* got object"),
    ((NNXMLP, NNXMLP, NNXMLP), r"model must be .* got tuple"),
    (lambda key: EqxLinear(key, outputs=3),
     r"model <lambda> gives outputs of shape \(3,\) per example, expected "
     r"num_classes = \(10,\)"),
    (lambda key: EqxLinear(key, inputs=100),
     r"model <lambda> does not accept inputs of input_shape \(8, 8, 1\)"),
    (_linear_pair(64, 3), r"model apply_linear gives outputs of shape \(3,\)"),
    (_linear_pair(100, 10),
     r"model apply_linear does not accept inputs of input_shape \(8, 8, 1\)"),
    (nn.Dense, r"flax\.linen\.Module class: pass an instance"),
    (WithBatchNorm, r"holds state other than nnx\.Param \(BatchStat\).*nnx\.LayerNorm"),
    (EqxWithBatchNorm, r"holds eqx\.nn\.State.*eqx\.nn\.LayerNorm"),
    (NoLinear, r"calls no flax\.nnx\.Linear layer.*declare it.*Parts\(output="),
    (ThreeOutputs, r"outputs of shape \(3,\).*num_classes = \(10,\)"),
    (WideInput, r"model WideInput does not accept inputs of input_shape \(8, 8, 1\)"),
], ids=["not-a-model", "an-object", "three-models", "eqx-classes", "eqx-input",
        "pair-classes", "pair-input", "linen-class", "batchnorm", "eqx-batchnorm",
        "no-linear", "classes", "input"])
def test_a_model_that_cannot_serve_is_refused_naming_why(model, message, digits):
  with pytest.raises(ValueError, match=message):
    simulate.prepare(CONFIG, 0, dataset=digits, model=model)


def test_a_flower_node_refuses_a_model_that_does_not_fit_its_data():
  flower = pytest.importorskip("pflax.flower")
  with pytest.raises(RuntimeError, match=r"node 1 failed to register: ValueError: model "
                     r"ThreeOutputs gives outputs of shape \(3,\) per example"):
    flower.run_in_process(flower.Experiment("fedavg", FLOWER_CONFIG, 0,
                                            model=ThreeOutputs))


def test_a_builder_called_with_an_nnx_model_asks_for_its_parts():
  with pytest.raises(ValueError, match=r"cwfedavg reads the output layer of model NNXMLP"):
    algorithms.cwfedavg(NNXMLP, optax.sgd(0.1))
