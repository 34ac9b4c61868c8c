"""Behaviours a one-line slip would change without failing any other test (issue 34):
fine-tuned models persist for absent clients, and heterogeneous groups never share
a training key."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pflax import algorithms
from pflax import models
from pflax import simulate
from pflax._src.simulation import engine
from pflax._src.simulation import protocol
from pflax._src.simulation import experiment as experiment_lib

M = 4


def _leaves_equal(a, b):
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a),
                                                  jax.tree.leaves(b)))


def _client(tree, i):
  return jax.tree.map(lambda x: np.asarray(x[i]), tree)


@pytest.mark.parametrize("name", ["fedavg_ft", "fedbabu"])
def test_a_fine_tuned_client_keeps_its_model_in_every_later_round(name):
  """Once client 0 has fine-tuned (round 1), every later evaluation uses its
  fine-tuned model, also in rounds 2 and 3 where it is absent; client 3, never
  present, is evaluated with the global model."""
  algorithm = algorithms.METHODS[name].builder(models.MLP(3, hidden=(4,)), optax.sgd(0.1))
  params = jax.vmap(lambda k: models.MLP(3, hidden=(4,)).init(k, jnp.ones((1, 5)))[
      "params"])(jax.random.split(jax.random.key(0), M))
  params = jax.tree.map(lambda x: jnp.broadcast_to(x[0], x.shape), params)
  state = algorithm.init(params, jnp.ones((M, 3), jnp.int32), jax.random.key(1))
  masks = [[True, False, True, False], [False, True, False, False],
           [False, True, True, False]]
  tuned_in_round_1 = None
  for t, mask in enumerate(masks):
    start = algorithm.client_models(state)
    trained = jax.tree.map(lambda x, t=t: x + (t + 1) * (1.0 + jnp.arange(M).reshape(
        (M,) + (1,) * (x.ndim - 1))), start)
    state = algorithm.server_update(state, trained, jnp.array(mask),
                                    jax.random.key(t))
    personalized = algorithm.evaluate(state)["personalized"]
    if t == 0:
      tuned_in_round_1 = _client(personalized, 0)
    else:   # client 0 absent: still its round-1 fine-tuned model
      assert _leaves_equal(_client(personalized, 0), tuned_in_round_1), t
    global_model = algorithm.evaluate(state)["global"]
    assert _leaves_equal(_client(personalized, 3), _client(global_model, 3))
    assert not _leaves_equal(_client(personalized, 0), _client(global_model, 0))


def test_clients_of_different_architecture_groups_never_share_a_training_key():
  config = simulate.ExperimentConfig(clients=8, rounds=1, model="mlp", local_epochs=1,
                                     heterogeneous=True, family="mlp")
  setup = simulate.prepare(config, seed=0)
  plan = experiment_lib.plan("fedavg", config, setup, config.clients, "vmap", None)
  groups = plan.build(None)
  assert len(groups.clients) > 1
  feds = tuple(jax.tree.map(lambda a, index=index: np.asarray(a)[np.asarray(index)],
                            setup.federation) for index in groups.clients)
  carry = engine.initial_carry(groups, setup.federation.x[0, :1],
                               jnp.asarray(setup.federation.counts), jnp.int32(0))
  for t in range(2):
    inputs = engine.round_inputs(plan, groups, carry, feds, jnp.int32(0),
                                 jnp.int32(t))
    engine_keys = np.concatenate([np.asarray(jax.random.key_data(c.keys))
                                  for c in inputs.clients])
    assert len({k.tobytes() for k in engine_keys}) == config.clients
    # A Flower node trains with the same key as the engine's client.
    flower_keys = protocol.training_keys(groups, 0, t)[1]
    order = np.concatenate([np.asarray(index) for index in groups.clients])
    np.testing.assert_array_equal(flower_keys[order], engine_keys)
    assert len({k.tobytes() for k in flower_keys}) == config.clients
