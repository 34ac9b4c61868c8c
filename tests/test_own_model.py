"""Your own Flax model: every algorithm trains plain models with their own layer
names, parts are found or declared, and a model that cannot serve is refused
before anything is compiled."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pflax import algorithms
from pflax import data
from pflax import models
from pflax import simulate
from pflax import train
from pflax import tree
from pflax._src.simulation import engine
from pflax._src.simulation import experiment as experiment_lib

ALGORITHMS = tuple(algorithms.METHODS)


class PlainMLP(nn.Module):
  """A user's MLP: Dense_0..Dense_2, nothing named pflax's way."""
  @nn.compact
  def __call__(self, x):
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(32)(x))
    x = nn.relu(nn.Dense(16)(x))
    return nn.Dense(10)(x)


class PlainCNN(nn.Module):
  """A user's CNN: Conv_0, then Dense_1 (16), then Dense_0 (10, the output)."""
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(4, (3, 3))(x))
    x = x.reshape(x.shape[0], -1)
    return nn.Dense(10)(nn.relu(nn.Dense(16)(x)))


def _digits(n: int = 300) -> data.Dataset:
  full = data.load_digits()
  return full._replace(images=full.images[:n], labels=full.labels[:n])


CONFIG = simulate.ExperimentConfig(clients=4, rounds=2, local_epochs=1,
                                   partition="dirichlet", dirichlet_alpha=1.0,
                                   strategy="vmap")


@pytest.fixture(scope="module", name="digits")
def _digits_fixture():
  return _digits()


@pytest.mark.parametrize("model", [
    PlainMLP(), pytest.param(PlainCNN(), marks=[pytest.mark.slow, pytest.mark.extended])], ids=["mlp", "cnn"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_trains_a_plain_model(algorithm, model, digits):
  run = simulate.run(algorithm, CONFIG, 0, dataset=digits, model=model)
  assert len(run.history) == 2
  summary = run.summary()
  assert 0.0 <= summary.best <= 1.0 and np.isfinite(summary.final)
  norms = np.asarray(run.output_norms)
  assert norms.shape == (CONFIG.clients, 10) and np.all(np.isfinite(norms))
  assert np.all(norms > 0)


def test_the_last_dense_layer_is_the_output_by_default():
  assert models.model_parts(PlainMLP(), (8, 8, 1), 10).output == tree.under("Dense_2")
  # PlainCNN constructs Dense(10) first (Dense_0) but calls it last.
  assert models.model_parts(PlainCNN(), (8, 8, 1), 10).output == tree.under("Dense_0")
  seq = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(10)])
  assert models.model_parts(seq, (5,), 10).output == tree.under("layers_2")


def test_output_norms_read_the_declared_layer(digits):
  setup = simulate.prepare(CONFIG, 0, dataset=digits, model=PlainMLP())
  params = models.init_stacked(setup.model, jax.random.key(0), setup.federation.x[0, :1],
                               3)
  norms = engine.output_norms(params, setup.parts.output)
  expected = jnp.linalg.norm(params["Dense_2"]["kernel"], axis=-2)
  np.testing.assert_allclose(norms, expected, rtol=1e-6)


def test_a_declared_head_replaces_the_default(digits):
  """cwFedAvg's WDR and p~ act on the declared layer: declaring Dense_1 (16 wide,
  not K) is refused; declaring Dense_2 equals the default."""
  default = simulate.prepare(CONFIG, 0, dataset=digits, model=PlainMLP())
  declared = simulate.prepare(CONFIG, 0, dataset=digits, model=PlainMLP(),
                              parts=models.Parts(output=tree.under("Dense_2")))
  assert declared.parts == default.parts
  with pytest.raises(ValueError, match=r"parts.output .* kernel of shape \(32, 16\)"):
    simulate.prepare(CONFIG, 0, dataset=digits, model=PlainMLP(),
                     parts=models.Parts(output=tree.under("Dense_1")))


def test_plans_of_one_user_model_compile_once(digits):
  """Parts compare by value, so a second run of the same model reuses the programs."""
  config = dataclasses.replace(CONFIG, rounds=1)
  simulate.run("fedavg", config, 0, dataset=digits, model=PlainMLP())
  before = engine.cached_programs.cache_info().hits
  simulate.run("fedavg", config, 1, dataset=digits, model=PlainMLP())
  assert engine.cached_programs.cache_info().hits == before + 1


class TwoOutputs(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(x.reshape(x.shape[0], -1))


class NoDense(nn.Module):
  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.zeros, (int(np.prod(x.shape[1:])), 10))
    return x.reshape(x.shape[0], -1) @ w


def test_a_model_that_cannot_be_hashed_runs(digits):
  """`nn.Sequential` holds a list of layers: its plan is built without the cache."""
  seq = nn.Sequential([lambda x: x.reshape(x.shape[0], -1), nn.Dense(16), nn.relu,
                       nn.Dense(10)])
  config = dataclasses.replace(CONFIG, rounds=1)
  run = simulate.run("cwfedavg", config, 0, dataset=digits, model=seq)
  assert np.all(np.isfinite(run.output_norms))


def test_a_model_that_does_not_fit_the_data_is_refused(digits):
  with pytest.raises(ValueError, match=r"outputs of shape \(3,\).*num_classes = \(10,\)"):
    simulate.prepare(CONFIG, 0, dataset=digits, model=TwoOutputs())
  setup = simulate.prepare(CONFIG, 0, dataset=digits, model=PlainMLP())
  with pytest.raises(ValueError, match="num_classes must be the federation's 10"):
    simulate.Setup(setup.federation, PlainMLP(), setup.input_shape, 5)
  with pytest.raises(ValueError, match=r"input_shape must be .*\(8, 8, 1\), got \(28, 28, 1\)"):
    simulate.Setup(setup.federation, PlainMLP(), (28, 28, 1), 10)


def test_a_model_without_a_dense_output_names_what_to_declare(digits):
  with pytest.raises(ValueError, match=r"calls no flax.linen.Dense.*Parts\(output="):
    simulate.prepare(CONFIG, 0, dataset=digits, model=NoDense())


def test_fedrema_needs_the_function_of_a_classifier_of_several_layers(digits):
  parts = models.Parts(output=tree.under("Dense_2"),
                       classifier=lambda path, leaf: path[0] in ("Dense_1", "Dense_2"))
  with pytest.raises(ValueError, match="fedrema cannot run on model PlainMLP.*"
                                       "apply_classifier"):
    simulate.run("fedrema", CONFIG, 0, dataset=digits, model=PlainMLP(), parts=parts)
  dense = lambda p, h, name: h @ p[name]["kernel"] + p[name]["bias"]
  parts = parts._replace(apply_classifier=lambda p, h: dense(
      p, jax.nn.relu(dense(p, h, "Dense_1")), "Dense_2"))
  run = simulate.run("fedrema", CONFIG, 0, dataset=digits, model=PlainMLP(),
                     parts=parts)
  assert np.isfinite(run.summary().final)


def test_builders_ask_for_the_parts_of_a_model_that_is_not_pflaxs():
  for builder in (algorithms.cwfedavg, algorithms.fedclassavg,
                  algorithms.fedrema):
    with pytest.raises(ValueError, match=r"PlainMLP.*parts=pflax.models.model_parts"):
      builder(PlainMLP(), optax.sgd(0.1))
  algorithms.cwfedavg(PlainMLP(), optax.sgd(0.1),
                      parts=models.Parts(output=tree.under("Dense_2")))


def test_heterogeneous_refuses_a_model_of_your_own(digits):
  config = dataclasses.replace(CONFIG, heterogeneous=True)
  with pytest.raises(ValueError, match="heterogeneous=True trains pflax's family"):
    simulate.run("fedavg", config, 0, dataset=digits, model=PlainMLP())


def test_a_custom_algorithm_that_reads_pflax_names_is_refused_before_training(digits):
  def needs_pflax_names(model, optimizer):
    fedavg = algorithms.fedavg(model, optimizer)
    return fedavg._replace(server_update=lambda state, trained, mask, key: state._replace(
        model=jax.tree.map(lambda x: x[0], trained["classifier"])))
  with pytest.raises(ValueError, match="needs_pflax_names cannot run on model "
                                       "PlainMLP: KeyError"):
    simulate.run(needs_pflax_names, CONFIG, 0, dataset=digits, model=PlainMLP())


def test_a_prepared_federation_is_used_as_it_is(digits):
  setup = simulate.prepare(CONFIG, 3, dataset=digits, model=PlainMLP())
  config = dataclasses.replace(CONFIG, rounds=1)
  a = simulate.run("fedavg", config, 0, dataset=setup.federation, model=PlainMLP())
  b = simulate.run("fedavg", config, 0, setup=setup)
  assert a.history[0].accuracies == b.history[0].accuracies
  with pytest.raises(ValueError, match="not both"):
    simulate.sweep("fedavg", config, [0], setups={0: setup}, model=PlainMLP())


class VectorMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))


def test_fedclassavg_refuses_inputs_that_are_not_images():
  rng = np.random.default_rng(0)
  vectors = data.from_arrays(rng.normal(size=(120, 5)).astype(np.float32),
                             rng.integers(0, 3, 120))
  with pytest.raises(ValueError, match=r"fedclassavg cannot run on model VectorMLP: "
                                       r"ValueError: translate augments images"):
    simulate.run("fedclassavg", CONFIG, 0, dataset=vectors, model=VectorMLP())


def test_heterogeneous_members_read_their_own_parts(digits):
  """Regression: the parts of the setup's model went to every architecture of the
  heterogeneous family, so FedClassAvg's representation applied the first
  architecture to the others' parameters."""
  config = dataclasses.replace(CONFIG, heterogeneous=True)
  setup = simulate.prepare(config, 0, dataset=digits)
  plan = experiment_lib.plan("fedclassavg", config, setup, config.clients,
                            "vmap", None)
  groups = plan.build(None)
  assert len(set(groups.models)) > 1
  x = jnp.zeros((2, *setup.input_shape))
  batch = train.Batch(x, jnp.zeros(2, jnp.int32), jnp.ones(2, bool))
  key = jax.random.key(0)
  for member, model in zip(groups.members, groups.models):
    params = model.init(key, x)["params"]
    head = tree.selected(params, algorithms.OUTPUT_LAYER)
    assert jnp.isfinite(member.loss(params, head, batch, key))
