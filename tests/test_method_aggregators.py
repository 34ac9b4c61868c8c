"""Each method's server step is written with the public `pflax.aggregate`
functions: which ones every method calls, and rounds of cwFedAvg and
FedClassAvg equal to their standalone aggregators."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pflax import aggregate as agg
from pflax import algorithms
from pflax import models
from pflax import simulate
from pflax._src import aggregators
from pflax._src.core import prng

import references as ref

M, K = 4, 3
MODEL = models.MLP(K, hidden=(4, 3))
OPTIMIZER = simulate.client_optimizer("sgd", 0.05)
KEY = prng.key(0)
COUNTS = jnp.asarray([[3, 0, 1], [0, 4, 2], [1, 1, 0], [2, 0, 5]], jnp.int32)
N = COUNTS.sum(axis=1)
PARTIAL = np.array([True, False, True, True])


def _random_params(seed, scale=1.0):
  shapes = jax.eval_shape(MODEL.init, KEY, jnp.zeros((1, 4, 4, 1)))["params"]
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda s: jnp.asarray(scale * rng.normal(size=(M, *s.shape)), jnp.float32), shapes)


INIT = jax.tree.map(lambda x: jnp.broadcast_to(x[:1], x.shape), _random_params(0))
TRAINED = _random_params(1)


def _rows(tree, mask):
  return jax.tree.map(lambda x: np.asarray(x)[np.asarray(mask)], tree)


def _where(mask, new, old):
  return jax.tree.map(
      lambda a, b: jnp.where(mask.reshape((-1,) + (1,) * (a.ndim - 1)), a, b), new, old)


# ------------------------------------------ which aggregators each method calls


# Method -> the `pflax.aggregate` functions of its server step (then, after the
# "|", those of `client_models`, the models the server hands out).
CALLS = {
    "apfl": {"fedavg"},
    "cwfedavg": {"estimate_class_dist", "class_models", "fedavg", "|personalize"},
    "ditto": {"fedavg"},
    "fedala": {"fedavg"},
    "fedavg": {"fedavg"},
    "fedavg_ft": {"fedavg"},
    "fedbabu": {"fedavg"},
    "fedclassavg": {"fedavg"},
    "feddwa": {"feddwa"},
    "fedper": {"fedavg"},
    "fedprox": {"fedavg"},
    "fedrema": {"probe_logits", "soft_logits", "fedrema"},
    "fedrep": {"fedavg"},
    "fedsa": {"fedsa"},
    "local": set(),
    "moon": {"fedavg"},
}
ROBUST_CALLS = {
    (("robust", "median"),): {"median"},
    (("robust", "trimmed_mean"),): {"trimmed_mean"},
    (("max_share", 0.5),): {"capped_weights", "fedavg"},
    (("clip_norm", 1.0),): {"clip_updates", "fedavg"},
}


def _spy_on_aggregators(monkeypatch):
  """Records the calls of every `pflax.aggregate` function, by name, wherever a
  method or a helper looks it up (`pflax._src.aggregators.<module>.<name>`);
  not the calls one of them makes itself (`clip_updates`' `log2_update_norms`)."""
  calls, depth = [], [0]
  for module in vars(aggregators).values():
    if not hasattr(module, "__file__"):
      continue
    for name in agg.__all__:
      fn = getattr(module, name, None)
      if callable(fn) and fn is getattr(agg, name) and not isinstance(fn, type):
        def spy(*args, _fn=fn, _name=name, **kwargs):
          if not depth[0]:
            calls.append(_name)
          depth[0] += 1
          try:
            return _fn(*args, **kwargs)
          finally:
            depth[0] -= 1
        monkeypatch.setattr(module, name, spy)
  return calls


def _called(monkeypatch, name, **kwargs):
  calls = _spy_on_aggregators(monkeypatch)
  algorithm = algorithms.METHODS[name].builder(MODEL, OPTIMIZER, **kwargs)
  state = algorithm.init(INIT, COUNTS, KEY)
  trained = jax.tree.map(lambda x: x + 0.1, algorithm.client_models(state))
  calls.clear()
  state = algorithm.server_update(state, trained, jnp.asarray(PARTIAL), KEY)
  server = set(calls)
  calls.clear()
  algorithm.client_models(state)
  return server | {f"|{c}" for c in calls}


def test_every_method_is_listed():
  assert set(CALLS) == set(algorithms.METHODS)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_server_step_calls_the_public_aggregators(monkeypatch, name):
  assert _called(monkeypatch, name) == CALLS[name]


@pytest.mark.parametrize("name", ["fedavg", "fedprox"])
@pytest.mark.parametrize("option", list(ROBUST_CALLS))
def test_robust_options_call_the_public_aggregators(monkeypatch, name, option):
  assert _called(monkeypatch, name, **dict(option)) == ROBUST_CALLS[option]


def test_methods_do_not_mix_parameters_themselves():
  """Weights and mixes of stacked clients belong to the aggregators."""
  private_maths = re.compile(r"\b(mix_leaf|mix_factored_leaf|client_weights|"
                             r"class_weights|row_distribution|weighted_mean|tree_lib\.mix)\b"
                             r"|jnp\.(tensordot|matmul|einsum)\b")
  methods = pathlib.Path(algorithms.__file__).parent / "_src" / "methods"
  found = {path.name: private_maths.findall(path.read_text())
           for path in sorted(methods.glob("*.py"))}
  assert {name: hits for name, hits in found.items() if hits} == {}


# ----------------------------------- a method round is its public aggregator


@pytest.mark.parametrize("class_dist", ["estimated", "empirical"])
@pytest.mark.parametrize("layers", ["output", "all"])
@pytest.mark.parametrize("mask", [np.ones(M, bool), PARTIAL], ids=["full", "partial"])
def test_cwfedavg_round_is_cw_fedavg(class_dist, layers, mask):
  """A first round of the cwFedAvg method hands its participants (every client,
  with full participation) `cw_fedavg(uploads, p~, n, where=class-wise layers)`."""
  algorithm = algorithms.cwfedavg(MODEL, OPTIMIZER, layers=layers, class_dist=class_dist)
  state = algorithm.init(INIT, COUNTS, KEY)
  trained = _where(mask, TRAINED, algorithm.client_models(state))
  state = algorithm.server_update(state, trained, jnp.asarray(mask), KEY)
  dist = (agg.estimate_class_dist(trained["classifier"]["output"]["kernel"])
          if class_dist == "estimated" else COUNTS)
  where = algorithms.OUTPUT_LAYER if layers == "output" else None
  expected = agg.cw_fedavg(trained, dist, N, where=where, mask=mask)
  # The method computes class models, then mixes them; cw_fedavg mixes once,
  # possibly in the other order: float32 rounding apart.
  ref.assert_tree_close(_rows(algorithm.client_models(state), mask),
                        _rows(expected, mask), rtol=1e-5, atol=1e-6)


def test_fedclassavg_round_is_fedclassavg():
  """A FedClassAvg round hands its participants `fedclassavg(uploads, n,
  where=classifier)` exactly, and every client (absent ones too) the averaged
  classifier."""
  algorithm = algorithms.fedclassavg(MODEL, OPTIMIZER)
  state = algorithm.init(INIT, COUNTS, KEY)
  mask = jnp.asarray(PARTIAL)
  trained = _where(mask, TRAINED, algorithm.client_models(state))
  models_ = algorithm.client_models(algorithm.server_update(state, trained, mask, KEY))
  expected = agg.fedclassavg(trained, N, where=algorithms.OUTPUT_LAYER, mask=mask)
  jax.tree.map(np.testing.assert_array_equal, _rows(models_, PARTIAL),
               _rows(expected, PARTIAL))
  head = _rows(expected["classifier"]["output"], PARTIAL)
  for x, mean in zip(jax.tree.leaves(models_["classifier"]["output"]),
                     jax.tree.leaves(head)):
    np.testing.assert_array_equal(x, np.broadcast_to(mean[0], x.shape))
