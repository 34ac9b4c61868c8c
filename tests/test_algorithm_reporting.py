"""What the algorithms evaluate and how runs report it (issue 11: 7, 10, 12, 13, 16)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax

from pflax import algorithms
from pflax import models
from pflax import simulate
from pflax._src.core import prng
from pflax._src.simulation import engine
from pflax._src.simulation import keys as keys_lib
from pflax._src.simulation import records
from pflax._src.training import losses
from pflax._src.training import train

SGD = optax.sgd(0.1)


def _numpy_params(model, input_shape, seed=0):
  abstract = jax.eval_shape(model.init, jax.random.key(0),
                            jax.ShapeDtypeStruct((1, *input_shape), jnp.float32))
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32),
                      abstract["params"])


def test_fedclassavg_personalized_model_is_own_features_with_own_classifier():
  # Item 7: own heads classify every test sample right, the global head none.
  eye, swap = np.eye(2, dtype=np.float32), np.eye(2, dtype=np.float32)[::-1]
  dense = lambda kernel: {"kernel": jnp.asarray(np.stack([kernel, kernel])),
                          "bias": jnp.zeros((2, 2))}
  params = {"features": {"dense_0": dense(eye)},
            "classifier": {"hidden_0": dense(eye), "output": dense(eye)}}
  state = algorithms.SharedHead(
      params, {"classifier": {"output": {"kernel": jnp.asarray(swap),
                                         "bias": jnp.zeros(2)}}}, jnp.ones(2))
  model = models.MLP(2, hidden=(2, 2))
  held = algorithms.fedclassavg(model, SGD).evaluate(state)
  assert set(held) == {"personalized", "global"}
  x, y = jnp.asarray([[1.0, 0.0], [0.0, 2.0], [3.0, 1.0]]), jnp.asarray([0, 1, 0])
  apply = lambda p, x: model.apply({"params": p}, x)
  for kind, expected in (("personalized", 3), ("global", 0)):
    for i in range(2):
      client = jax.tree.map(lambda a, i=i: a[i], held[kind])
      correct = train.evaluate_client(apply, client, x, y, jnp.ones(3, bool))
      assert int(correct) == expected


def test_fedclassavg_supcon_receives_the_pre_relu_representation(monkeypatch):
  # Item 12: the authors' SupCon sees `fcin`'s linear output, before the ReLU.
  model = models.MLP(3, hidden=(5, 4))
  params = _numpy_params(model, (8, 8, 1))
  # Constant images: the pad-and-crop augmentation leaves them unchanged.
  x = np.broadcast_to(np.asarray([0.5, -1.0, 2.0, 1.5], np.float32)[:, None, None, None],
                      (4, 8, 8, 1))
  seen, supcon = [], losses.supcon
  spy = lambda f, *args, **kwargs: seen.append(f) or supcon(f, *args, **kwargs)
  monkeypatch.setattr(losses, "supcon", spy)
  batch = train.Batch(jnp.asarray(x), jnp.asarray([0, 1, 1, 2]), jnp.ones(4, bool))
  head = {"classifier": {"output": params["classifier"]["output"]}}
  algorithms.fedclassavg(model, SGD).loss(params, head, batch, prng.key(0))
  f, c = params["features"]["dense_0"], params["classifier"]["hidden_0"]
  h = np.maximum(x.reshape(4, -1) @ f["kernel"] + f["bias"], 0.0)
  z = h @ c["kernel"] + c["bias"]
  assert (z < 0).any()  # post-ReLU features would differ
  np.testing.assert_allclose(seen[0], np.concatenate([z, z]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("participation,expected", [(0.1, 2), (0.25, 5), (1.0, 20)])
def test_heterogeneous_participants_are_drawn_over_all_clients(participation, expected):
  # Item 10: round(p M) clients of all M, not max(1, round(p M_g)) per group
  # (p = 0.1 of four groups of 5 drew 4 clients). Each group trains a static
  # number of its clients, its participants first; the others are dropped.
  clients = tuple(np.arange(g, 20, 4) for g in range(4))
  count = keys_lib.num_participants(participation, 20)
  for seed in range(4):
    chosen = keys_lib.participants(prng.key(seed), 20, participation)
    assert len(chosen) == expected
    took_part = jnp.zeros(20, bool).at[chosen].set(True)
    trained = set()
    for index in clients:
      picked = engine._group_chosen(took_part, index, count, count == 20)
      positions = np.arange(len(index)) if picked is None else np.asarray(picked)
      assert len(positions) == min(count, len(index))
      trained |= {int(index[p]) for p in positions if took_part[index[p]]}
    assert trained == set(np.asarray(chosen).tolist())


def test_accuracies_weighted_and_unweighted_over_clients():
  # Item 13: by hand; the client without test samples has no accuracy.
  out = records.Accuracy.of(np.array([3, 1, 0]), np.array([4, 2, 0]))
  assert (out.accuracy, out.client_mean, out.client_std) == pytest.approx(
      (4 / 6, 0.625, 0.125))


def test_feddwa_reports_exclusive_models_never_as_global():
  # Item 16.
  state = algorithms.ExclusiveModels({"w": jnp.zeros((2, 1))}, {"w": jnp.ones((2, 1))})
  held = algorithms.feddwa(models.MLP(2), SGD).evaluate(state)
  assert set(held) == {"personalized", "exclusive"}
  np.testing.assert_array_equal(held["personalized"]["w"], 1.0)


def _run(name, weighted, mean, std, global_=None, exclusive=None):
  accuracies = {"personalized": records.Accuracy(weighted, mean, std)}
  if global_:
    accuracies["global"] = records.Accuracy(global_, global_, 0.0)
  if exclusive:
    accuracies["exclusive"] = records.Accuracy(exclusive, exclusive, 0.0)
  history = (records.RoundRecord(1, 0.0, accuracies=accuracies),)
  return simulate.RunRecord(name, 0, history, 0.0, np.zeros((1, 1)))


def test_table_shows_exclusive_and_per_client_columns():
  runs = [_run("fedavg", 0.9, 0.8, 0.1, global_=0.5),
          _run("feddwa", 0.95, 0.9, 0.05, exclusive=0.4)]
  table = simulate.Results.of(runs).table().splitlines()
  assert "global final | exclusive final" in table[0]
  cells = lambda row: [c.strip() for c in row.strip("|").split("|")]
  assert cells(table[2]) == ["fedavg", "90.00", "90.00", "90.00", "80.00 (10.00)",
                             "50.00", "—"]
  assert cells(table[3]) == ["feddwa", "95.00", "95.00", "95.00", "90.00 (5.00)", "—",
                             "40.00"]
