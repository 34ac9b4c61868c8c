"""Each algorithm's pieces against hand computations and `references.py`.

For every method of `METHODS`: the local loss value on a fixed batch, the
optimizer and its state's lifecycle (fresh each round, or kept by FedReMa), the
models `evaluate` returns, and the server step when a client is absent, uploads
non-finite parameters, or is padding (the sharded sweep's empty clients). The
generic tests read each method's `TestSpec` (`Method.test`, in its file) and its
independent NumPy `Reference` (`REFERENCES`), never its name.

A tiny MLP (16 -> 4 -> 3 -> 3) on constant 4x4 images keeps everything fast;
constant images make FedClassAvg's random translations the identity, so its
two views equal the input and its loss has a closed form.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pflax import algorithms
from pflax import data
from pflax import models
from pflax import simulate
from pflax import train
from pflax._src.core import prng
from pflax._src.data import federation as federation_lib
from pflax._src.simulation import engine
from pflax._src.simulation import groups as groups_lib
from pflax._src.simulation import keys as keys_lib

import references as ref

M, K, L = 4, 3, 4
IMAGE = (4, 4, 1)
MODEL = models.MLP(K, hidden=(4, 3))
NAMES = tuple(algorithms.METHODS)
# How the tests drive each method (`Method.test`, in the method's file): its
# hyperparameters, each away from its default so a wrongly wired one shows, and
# the tree its clients train.
SPECS = {name: method.test for name, method in algorithms.METHODS.items()}
KWARGS = {name: dict(spec.kwargs) for name, spec in SPECS.items()}
N = np.array([3, 4, 2, 4])          # training samples per client
ABSENT = 1                          # the client left out of the partial rounds
LR, MOMENTUM = 0.05, 0.9                      # the shared SGD base
ADAM_LR, ADAM_B1 = 0.01, 0.5                  # the own Adam of a method (FedClassAvg)
# Clients training one part, then the other (`phases.two_phases`): FedRep's head
# (the output layer) then body, FedALA's weights then model.
PHASED = tuple(name for name, spec in SPECS.items() if spec.phased)
KEY = prng.key(0)


# ------------------------------------------------------------------ fixtures


def _random_params(rng, m, scale=1.0):
  """A stacked MLP parameter tree with `m` different clients, float32."""
  shapes = jax.eval_shape(MODEL.init, KEY, jnp.zeros((1, *IMAGE)))["params"]
  return jax.tree.map(
      lambda s: jnp.asarray(scale * rng.normal(size=(m, *s.shape)), jnp.float32), shapes)


def _federation(num_samples):
  """Constant images (one value per sample), first `n_i` samples valid."""
  rng = np.random.default_rng(1)
  m = len(num_samples)
  values = rng.uniform(-1.0, 1.0, size=(m, L))
  x = np.broadcast_to(values[..., None, None, None], (m, L, *IMAGE)).astype(np.float32)
  y = rng.integers(0, K, size=(m, L)).astype(np.int32)
  valid = np.arange(L)[None, :] < np.asarray(num_samples)[:, None]
  counts = np.stack([np.bincount(y[i][valid[i]], minlength=K) for i in range(m)])
  return data.Federation(x=x, y=y, mask=valid, test_x=x, test_y=y, test_mask=valid,
                        counts=counts.astype(np.int32),
                        num_samples=np.asarray(num_samples, np.int32))


FED = _federation(N)
INIT = _random_params(np.random.default_rng(2), M)       # P: clients' initial models
TRAINED = jax.tree.map(lambda p, d: p + d, INIT,          # T: what they upload
                       _random_params(np.random.default_rng(3), M, scale=0.5))


def _own_adam(name):
  """Whether the method trains with its own Adam (`Method.optimizer`)."""
  own = algorithms.METHODS[name].optimizer
  return own is not None and own["optimizer"] == "adam"


@functools.cache
def _algorithm(name, grad_clip=None, lr=LR, momentum=MOMENTUM):
  if _own_adam(name):
    optimizer = simulate.client_optimizer("adam", ADAM_LR, adam_b1=ADAM_B1,
                                          grad_clip=grad_clip)
  else:
    optimizer = simulate.client_optimizer("sgd", lr, momentum, grad_clip=grad_clip)
  return algorithms.METHODS[name].builder(MODEL, optimizer, **KWARGS.get(name, {}))


def _init(algorithm, fed=None):
  return algorithm.init(INIT, jnp.asarray((fed or FED).counts), KEY)


def _opt_state(algorithm, state):
  return train.init_opt_state(algorithm.optimizer, algorithm.client_models(state))


@functools.cache
def _server_update(name):
  """The jitted server step, compiled once per algorithm for the whole file."""
  return jax.jit(_algorithm(name).server_update)


def _rows(tree, index):
  return jax.tree.map(lambda x: x[np.asarray(index)], tree)


def _choose(mask, new, old):
  """Per client: `new` where mask, else `old` (stacked JAX trees)."""
  return jax.tree.map(
      lambda a, b: jnp.where(mask.reshape((-1,) + (1,) * (a.ndim - 1)), a, b), new, old)


def _np(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def _where(mask, new, old):
  """Per client: `new` where mask, else `old` (NumPy)."""
  return jax.tree.map(
      lambda a, b: np.where(mask.reshape((-1,) + (1,) * (a.ndim - 1)), a, b),
      _np(new), _np(old))


def _broadcast(tree, m):
  return jax.tree.map(lambda x: np.stack([x] * m), tree)


def _with_output(params, output):
  return {**params, "classifier": {**params["classifier"], "output": output}}


def _split_output(params):
  """`(output layer, the other leaves)` of a parameter tree."""
  rest = {**params, "classifier": {k: v for k, v in params["classifier"].items()
                                   if k != "output"}}
  return params["classifier"]["output"], rest


def _fedrema_upload(trained):
  """Zero output kernels: the probe's logits are the output biases, whatever the probe."""
  out = trained["classifier"]["output"]
  return _with_output(trained, {**out, "kernel": jnp.zeros_like(out["kernel"])})


def _upload(name, trained):
  """The stacked upload of each algorithm, of the tree it trains (`TestSpec.trains`):
  a pair `(w, v)`, FedALA's weights and delta, or a model (`Reference.upload` of it)."""
  trains = SPECS[name].trains
  if trains == "pair":
    return {"w": trained, "v": jax.tree.map(lambda x: 0.5 * x, trained)}
  if trains == "ala":
    return {"weights": _ala_weights(8), "delta": jax.tree.map(lambda x: 0.5 * x, trained)}
  return REFERENCES[name].upload(trained)


def _ala_weights(seed):
  """Stacked FedALA weights in [0, 1] of the output layer, the ALA layer by default."""
  out = _split_output(INIT)[0]
  rng = np.random.default_rng(seed)
  return {"classifier": {"output": jax.tree.map(
      lambda x: jnp.asarray(rng.uniform(size=x.shape), jnp.float32), out)}}


def _ala_models(pair, local, global_model):
  """FedALA's trained models `ALA(W) + delta` (Eqs. 4-5), in NumPy."""
  out = ref.ala_ref(pair["weights"]["classifier"]["output"],
                    _split_output(local)[0], _split_output(global_model)[0])
  return jax.tree.map(np.add, _with_output(_np(global_model), out), _np(pair["delta"]))


# ----------------------------------------------------- NumPy model and losses


def _np_forward(params, x):
  """`(representation, logits)` of the MLP in float64: `z = hidden_0(relu(dense_0(x)))`
  before its ReLU (FedClassAvg's contrastive representation, the authors' `fcin`),
  `logits = output(relu(z))`."""
  p = _np(params)
  x = np.asarray(x, np.float64).reshape(len(x), -1)
  dense, hidden, output = (p["features"]["dense_0"], p["classifier"]["hidden_0"],
                           p["classifier"]["output"])
  h = np.maximum(x @ dense["kernel"] + dense["bias"], 0.0)
  z = h @ hidden["kernel"] + hidden["bias"]
  return z, np.maximum(z, 0.0) @ output["kernel"] + output["bias"]


BATCH_VALUES = np.array([0.3, -0.5, 0.8, 0.1, 2.0])
BATCH = train.Batch(
    x=jnp.asarray(np.broadcast_to(BATCH_VALUES[:, None, None, None], (5, *IMAGE)),
                  jnp.float32),
    y=jnp.array([0, 1, 0, 2, 1]),
    mask=jnp.array([True, True, True, True, False]))   # the last sample is padding


def _ce(params):
  return ref.cross_entropy_ref(_np_forward(params, BATCH.x)[1], np.asarray(BATCH.y),
                               np.asarray(BATCH.mask))


def _supcon(params):
  z = _np_forward(params, BATCH.x)[0]
  labels, mask = np.asarray(BATCH.y), np.asarray(BATCH.mask)
  return ref.supcon_ref(np.concatenate([z, z]), np.concatenate([labels, labels]),
                        KWARGS["fedclassavg"]["supcon_temperature"],
                        KWARGS["fedclassavg"]["supcon_base_temperature"],
                        np.concatenate([mask, mask]))


# -------------------------------------------------------------- expected state


def _fedrema_soft(trained):
  bias = _np(trained)["classifier"]["output"]["bias"]
  return ref.soft_logits_ref(bias, KWARGS["fedrema"]["temperature"])


class _Step(NamedTuple):
  """One server step from `init(init)`: the upload `trained` (rows outside `mask`
  ignored), the bool `(M,)` clients that took part and uploaded finite values,
  their indices `on`, the sample counts `n` and the participants' uploads `up`."""
  init: Any
  trained: Any
  mask: np.ndarray
  on: np.ndarray
  n: np.ndarray
  up: Any

  @property
  def m(self):
    return len(self.mask)


def _expected(name, init, trained, num_samples, mask):
  """The models `evaluate` returns after one server step from `init(init)`.

  Written from the papers (as settled in docs/methods.md) with `references.py`
  (`Reference.evaluated`); masked-out clients keep their state.
  """
  mask = np.asarray(mask)
  on = np.flatnonzero(mask)
  step = _Step(init, trained, mask, on, np.asarray(num_samples, np.float64),
               _rows(_np(trained), on))
  return REFERENCES[name].evaluated(step)


def _own(s):
  return {"personalized": _where(s.mask, s.trained, s.init)}


def _global_mean(mean):
  """A method holding one global model, `mean(up, n)` of the participants."""
  def evaluated(s):
    held = _broadcast(mean(s.up, s.n[s.on]), s.m)
    return {"personalized": held, "global": held}
  return evaluated


def _cwfedavg(s):
  out, rest = _split_output(s.up)
  dist = np.full((s.m, K), 1.0 / K)       # the initial p~, kept by absent clients
  dist[s.on] = ref.estimate_class_dist_ref(out["kernel"])
  class_models = ref.class_models_ref(out, dist[s.on], s.n[s.on])
  personal = ref.personalize_ref(class_models, dist)
  rest = _broadcast(ref.fedavg_ref(rest, s.n[s.on]), s.m)
  return {"personalized": _with_output(rest, personal)}


def _fedclassavg(s):
  own = _where(s.mask, s.trained, s.init)
  head = ref.fedavg_ref(_split_output(s.up)[0], s.n[s.on])
  return {"personalized": own, "global": _with_output(own, _broadcast(head, s.m))}


def _feddwa(s):
  kwargs = KWARGS["feddwa"]
  mixed = ref.feddwa_ref(s.up["w"], _rows(_np(s.init), s.on), kwargs["alpha"],
                         kwargs["temperature"])
  exclusive = jax.tree.map(lambda e, x: _set_rows(e, s.on, x), _np(s.init), mixed)
  return {"personalized": _where(s.mask, s.trained["v"], s.init),
          "exclusive": exclusive}


def _personal_output(s):
  """FedPer's personal layers, FedRep's head: the output layer."""
  base = _broadcast(ref.fedavg_ref(_split_output(s.up)[1], s.n[s.on]), s.m)
  own = _split_output(_where(s.mask, s.trained, s.init))[0]
  return {"personalized": _with_output(base, own)}


def _ditto(s):
  return {"personalized": _where(s.mask, s.trained["v"], s.init),
          "global": _broadcast(ref.fedavg_ref(s.up["w"], s.n[s.on]), s.m)}


def _fine_tuned(tuned, mean, s):
  """Clients that never trained are evaluated on the global model."""
  return {"personalized": _where(s.mask, tuned, _broadcast(mean, s.m)),
          "global": _broadcast(mean, s.m)}


def _fedavg_ft(s):
  return _fine_tuned(s.trained, ref.fedavg_ref(s.up, s.n[s.on]), s)


def _fedbabu(s):
  """The body averaged under the initial head."""
  head = _split_output(_rows(_np(s.init), 0))[0]
  return _fine_tuned(s.trained["v"],
                     _with_output(ref.fedavg_ref(s.up["w"], s.n[s.on]), head), s)


def _apfl(s):
  alpha = KWARGS["apfl"]["alpha"]
  mean = _broadcast(ref.fedavg_ref(s.up["w"], s.n[s.on]), s.m)
  personal = _where(s.mask, s.trained["v"], s.init)
  return {"personalized": jax.tree.map(lambda v, w: alpha * v + (1 - alpha) * w,
                                       personal, mean),
          "global": mean}


def _fedala(s):
  models = _ala_models(s.trained, s.init, _broadcast(_rows(_np(s.init), 0), s.m))
  return {"personalized": _where(s.mask, models, s.init),
          "global": _broadcast(ref.fedavg_ref(_rows(models, s.on), s.n[s.on]), s.m)}


def _fedrema(s):
  mixed, *_ = ref.fedrema_ref(s.up, s.n[s.on], _fedrema_soft(s.up),
                              np.zeros((len(s.on),) * 2), 0.0, True, 0.5)
  classifier = jax.tree.map(lambda e, x: _set_rows(e, s.on, x),
                            _np(s.init)["classifier"], mixed["classifier"])
  # Alg. 2 line 19: every client receives the averaged feature extractor.
  features = _broadcast(ref.fedavg_ref(s.up["features"], s.n[s.on]), s.m)
  return {"personalized": {"features": features, "classifier": classifier}}


def _set_rows(x, rows, values):
  x = np.array(x)
  x[rows] = values
  return x


def _assert_evaluated(algorithm, state, expected):
  got = algorithm.evaluate(state)
  assert set(got) == set(expected)
  for kind in expected:
    ref.assert_tree_close(got[kind], expected[kind], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- local loss


def _received():
  """The global model every client receives at init."""
  return _rows(INIT, 0)


def _ce_loss(q, client):
  del client
  return _ce(q)


def _pair_ce(q, client):
  del client
  return _ce(q["w"]) + _ce(q["v"])


def _ditto_loss(q, client):
  del client
  return _pair_ce(q, None) + KWARGS["ditto"]["lam"] * ref.proximal_ref(q["v"],
                                                                       _received())


def _apfl_loss(q, client):
  del client
  alpha = KWARGS["apfl"]["alpha"]
  mixed = jax.tree.map(lambda v, w: alpha * v + (1 - alpha) * w, _np(q["v"]),
                       _np(q["w"]))
  return _ce(q["w"]) + _ce(mixed)


def _moon_loss(q, client):
  """The global model and the client's previous one: INIT's rows."""
  z, z_glob, z_prev = (_np_forward(p, BATCH.x)[0]
                       for p in (q, _received(), _rows(INIT, client)))
  con = ref.model_contrastive_ref(z, z_glob, z_prev, KWARGS["moon"]["temperature"],
                                  np.asarray(BATCH.mask))
  return _ce(q) + KWARGS["moon"]["mu"] * con


def _fedala_loss(q, client):
  """The local model and the global one: INIT's rows."""
  return _ce(_ala_models(q, _rows(INIT, client), _received()))


def _fedprox_loss(q, client):
  del client
  return _ce(q) + KWARGS["fedprox"]["mu"] * ref.proximal_ref(q, _received())


def _cwfedavg_loss(q, client):
  p = np.asarray(FED.counts[client], np.float64)
  estimate = ref.estimate_class_dist_ref(_np(q)["classifier"]["output"]["kernel"])
  return _ce(q) + KWARGS["cwfedavg"]["wdr_coef"] * np.linalg.norm(p / p.sum() - estimate)


def _fedclassavg_loss(q, client):
  del client
  # SupCon's representation is taken before the ReLU: some of it is negative here.
  assert (_np_forward(q, BATCH.x)[0][np.asarray(BATCH.mask)] < 0).any()
  prox = ref.proximal_ref(q["classifier"]["output"], _received()["classifier"]["output"],
                          reduce="mean")
  return _ce(q) + _supcon(q) + KWARGS["fedclassavg"]["rho"] * prox


def _feddwa_loss(q, client):
  """After one full server step (`Reference.loss_after_a_round`)."""
  exclusive = _expected("feddwa", INIT, _upload("feddwa", TRAINED), N,
                        np.ones(M, bool))["exclusive"]
  anchor = _rows(exclusive, client)   # the exclusive model the client received
  return (_ce(q["w"]) + _ce(q["v"])
          + KWARGS["feddwa"]["lam"] * ref.proximal_ref(q["v"], anchor))


# --------------------------------------------------- each method's reference


def _momentum_steps(name, grads):
  """The shared SGD base's updates (lr, momentum)."""
  del name
  return _momentum_ref(grads, LR, MOMENTUM)


def _ala_steps(name, grads):
  """FedALA's weights from W = 0: clip(0 - eta g, 0, 1)."""
  return [np.clip(-KWARGS[name]["eta"] * g, 0.0, 1.0) for g in grads]


class Reference(NamedTuple):
  """A method's independent reference (NumPy, `references.py`).

  Attributes:
    evaluated: `evaluated(step) -> {kind: models}` after one server `_Step`.
    loss: `loss(q, client)`, client `client`'s local objective at `q` from
      `init(INIT)`.
    loss_after_a_round: whether `loss` is taken after one full server step
      instead (FedDWA: so that its exclusive and personal models differ).
    upload: the tests' upload of a method training a model, from `TRAINED`.
    first_steps: `first_steps(name, grads)`, the updates of the optimizer's first
      steps (of the first part of a phased method); Adam for a method with its
      own (`_own_adam`).
  """
  evaluated: Callable[[_Step], dict]
  loss: Callable[[Any, int], float]
  loss_after_a_round: bool = False
  upload: Callable[[Any], Any] = lambda trained: trained
  first_steps: Callable[[str, list], list] = _momentum_steps


REFERENCES = {
    "local": Reference(_own, _ce_loss),
    "fedavg": Reference(_global_mean(ref.fedavg_ref), _ce_loss),
    "fedprox": Reference(_global_mean(ref.fedavg_ref), _fedprox_loss),
    "cwfedavg": Reference(_cwfedavg, _cwfedavg_loss),
    "fedclassavg": Reference(_fedclassavg, _fedclassavg_loss),
    "fedsa": Reference(_global_mean(
        lambda up, n: ref.fedsa_ref(up, n, **KWARGS["fedsa"])), _ce_loss),
    "feddwa": Reference(_feddwa, _feddwa_loss, loss_after_a_round=True),
    "fedrema": Reference(_fedrema, _ce_loss, upload=_fedrema_upload),
    "fedper": Reference(_personal_output, _ce_loss),
    "ditto": Reference(_ditto, _ditto_loss),
    "fedavg_ft": Reference(_fedavg_ft, _ce_loss),
    "fedbabu": Reference(_fedbabu, _pair_ce),
    "fedrep": Reference(_personal_output, _ce_loss),
    "apfl": Reference(_apfl, _apfl_loss),
    "moon": Reference(_global_mean(ref.fedavg_ref), _moon_loss),
    "fedala": Reference(_fedala, _fedala_loss, first_steps=_ala_steps),
}


def test_every_method_has_a_reference_and_a_known_trained_tree():
  assert set(REFERENCES) == set(NAMES)
  assert {spec.trains for spec in SPECS.values()} <= {"model", "pair", "ala"}


def test_only_fedrema_keeps_its_optimizer_state_and_only_fedclassavg_has_its_adam():
  """The facts the generic tests read from the methods themselves."""
  assert [name for name in NAMES if _algorithm(name).keep_opt_state] == ["fedrema"]
  assert [name for name in NAMES if _own_adam(name)] == ["fedclassavg"]


def _trained_point(name, seed):
  """Random stacked parameters of the tree the method's clients train."""
  point = _random_params(np.random.default_rng(seed), M)
  trains = SPECS[name].trains
  if trains == "pair":
    return {"w": point, "v": _random_params(np.random.default_rng(seed + 1), M)}
  if trains == "ala":
    return {"weights": _ala_weights(seed + 1), "delta": point}
  return point


@pytest.mark.parametrize("name", NAMES)
def test_local_loss_value_by_hand(name):
  """CE (+ FedProx's mu/2 ||w - w_g||^2, cwFedAvg's WDR, FedClassAvg's SupCon and
  rho/2 sum_tensors mean((C - C_g)^2), FedDWA's pair with lambda/2 ||v - w_g||^2)."""
  algorithm = _algorithm(name)
  reference = REFERENCES[name]
  state = _init(algorithm)
  if reference.loss_after_a_round:
    _, state = _server_step(name, _upload(name, TRAINED), np.ones(M, bool))
  context = algorithm.client_context(state)
  point = _trained_point(name, 4)   # away from every anchor
  for client in range(M):
    q = _rows(point, client)
    got = algorithm.loss(q, _rows(context, client) if context is not None else None,
                         BATCH, prng.key(client))
    np.testing.assert_allclose(got, reference.loss(q, client), rtol=2e-5, atol=1e-5)


def test_apfl_gradients_reach_v_only_through_the_mixture():
  """Algorithm 1: `w` descends `CE(w)` alone, `v` descends `CE(v-bar)` with
  `v-bar = alpha v + (1 - alpha) w`, whose gradient in `v` is alpha times the
  mixture's."""
  algorithm = _algorithm("apfl")
  alpha = KWARGS["apfl"]["alpha"]
  pair = {"w": _rows(_random_params(np.random.default_rng(4), M), 0),
          "v": _rows(_random_params(np.random.default_rng(5), M), 0)}
  grads = jax.grad(algorithm.loss)(pair, None, BATCH, KEY)
  ce = algorithms.cross_entropy_loss(MODEL)
  mixed = jax.tree.map(lambda v, w: alpha * v + (1 - alpha) * w, pair["v"], pair["w"])
  ref.assert_tree_close(grads["w"], jax.grad(ce)(pair["w"], None, BATCH, KEY),
                        rtol=1e-5, atol=1e-6)
  ref.assert_tree_close(grads["v"], jax.tree.map(
      lambda g: alpha * g, jax.grad(ce)(mixed, None, BATCH, KEY)), rtol=1e-5, atol=1e-6)


def test_apfl_adaptive_alpha_descends_its_gradient_within_0_and_1():
  """`adapt_alpha`: `alpha_i`'s gradient is `<v - w, grad CE(v-bar)>`, its SGD step
  is projected on [0, 1], and the server keeps the participants' new `alpha_i`."""
  algorithm = algorithms.apfl(
      MODEL, simulate.client_optimizer("sgd", LR, MOMENTUM), alpha=0.3,
      adapt_alpha=True, alpha_lr=0.7)
  w, v = (_rows(_random_params(np.random.default_rng(seed), M), 0) for seed in (4, 5))
  trained = {"w": w, "v": v, "alpha": jnp.float32(0.3)}
  grads = jax.grad(algorithm.loss)(trained, None, BATCH, KEY)
  ce = algorithms.cross_entropy_loss(MODEL)
  g_mixed = jax.grad(ce)(jax.tree.map(lambda a, b: 0.3 * a + 0.7 * b, v, w), None,
                         BATCH, KEY)
  expected = sum(np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) * g)
                 for a, b, g in zip(*(jax.tree.leaves(t) for t in (v, w, g_mixed))))
  np.testing.assert_allclose(grads["alpha"], expected, rtol=1e-4, atol=1e-6)
  for grad, want in ((10.0, -0.3), (-10.0, 0.7), (0.1, -0.07)):   # clip(0.3 - 0.7 g)
    updates, _ = algorithm.optimizer.update({**grads, "alpha": jnp.float32(grad)},
                                            algorithm.optimizer.init(trained), trained)
    np.testing.assert_allclose(updates["alpha"], want, rtol=1e-5, atol=1e-6)
  state = _init(algorithm)
  np.testing.assert_array_equal(state.alpha, np.float32(0.3))
  upload = {**_upload("apfl", TRAINED), "alpha": jnp.array([0.1, 0.2, 0.9, 1.0])}
  start = algorithm.client_models(state)
  mask = np.arange(M) != ABSENT
  state = algorithm.server_update(state, _choose(mask, upload, start), jnp.asarray(mask),
                                  KEY)
  np.testing.assert_allclose(state.alpha, [0.1, 0.3, 0.9, 1.0])


@pytest.mark.parametrize("rho", [0.0, 0.8])
def test_fedclassavg_without_supcon_is_ce_on_the_first_view_plus_prox(rho):
  """`supcon=False` (the paper's Table 4 ablation): CE on the first augmented view
  (the same view as with SupCon) plus rho/2 sum_tensors mean((C - C_g)^2); rho = 0
  leaves CE alone. Random images, so the view is a real translation."""
  optimizer = simulate.client_optimizer("adam", ADAM_LR, adam_b1=ADAM_B1)
  kwargs = dict(KWARGS["fedclassavg"], rho=rho)
  without = algorithms.fedclassavg(MODEL, optimizer, supcon=False, **kwargs)
  with_supcon = algorithms.fedclassavg(MODEL, optimizer, **kwargs)
  rng = np.random.default_rng(6)
  batch = BATCH._replace(x=jnp.asarray(rng.uniform(size=(5, *IMAGE)), jnp.float32))
  state = _init(without)
  head = _rows(without.client_context(state), 0)
  q = _rows(_random_params(np.random.default_rng(4), M), 0)
  key = prng.key(7)
  view1 = data.translate(jax.random.split(key)[0], batch.x)
  assert not np.allclose(view1, batch.x)
  ce = ref.cross_entropy_ref(_np_forward(q, view1)[1], np.asarray(batch.y),
                             np.asarray(batch.mask))
  prox = ref.proximal_ref(q["classifier"]["output"], _np(head)["classifier"]["output"],
                          reduce="mean")
  got = without.loss(q, head, batch, key)
  np.testing.assert_allclose(got, ce + rho * prox, rtol=2e-5, atol=1e-6)
  z1, z2 = (_np_forward(q, v)[0]
            for v in (view1, data.translate(jax.random.split(key)[1], batch.x)))
  mask, labels = np.asarray(batch.mask), np.asarray(batch.y)
  contrast = ref.supcon_ref(np.concatenate([z1, z2]), np.concatenate([labels, labels]),
                            kwargs["supcon_temperature"],
                            kwargs["supcon_base_temperature"],
                            np.concatenate([mask, mask]))
  np.testing.assert_allclose(with_supcon.loss(q, head, batch, key),
                             ce + rho * prox + contrast, rtol=2e-5, atol=1e-5)


# -------------------------------------------------------- optimizer lifecycle


def _dirty(opt_state):
  """An optimizer state from earlier rounds: every entry, counts included, moved."""
  return jax.tree.map(lambda x: x + jnp.ones((), x.dtype), opt_state)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("chosen", [None, [0, 2, 3]], ids=["all", "partial"])
def test_optimizer_state_is_fresh_each_round_except_fedrema(name, chosen):
  """FedClassAvg: a new Adam each round (its paper); FedReMa keeps its momentum;
  the others' SGD (momentum here) starts afresh."""
  algorithm = _algorithm(name)
  state = _init(algorithm)
  previous = _dirty(_opt_state(algorithm, state))
  participants = None if chosen is None else jnp.asarray(chosen)
  inputs = engine._client_inputs(algorithm.client_models(state), previous,
                                 algorithm.client_context(state), FED, participants,
                                 functools.partial(keys_lib.client_keys, KEY))
  starting = jax.vmap(functools.partial(engine.start_opt_state, algorithm))(
      inputs.start, inputs.opt_state)
  got = jax.tree.leaves(starting)
  assert got, "the optimizer must have a state here (momentum or Adam)"
  if algorithm.keep_opt_state:
    kept = previous if chosen is None else _rows(previous, chosen)
    for a, b in zip(got, jax.tree.leaves(kept)):
      np.testing.assert_array_equal(a, b)
  else:
    for leaf in got:   # fresh momentum / Adam moments and step counts are all zero
      assert leaf.shape[0] == (M if chosen is None else len(chosen))
      np.testing.assert_array_equal(leaf, np.zeros_like(leaf))


def test_fedrema_stores_participants_momentum_and_keeps_the_others():
  algorithm = _algorithm("fedrema")
  state = _init(algorithm)
  previous = _dirty(_opt_state(algorithm, state))
  chosen = jnp.array([0, 2, 3])
  new_opt = jax.tree.map(lambda x: jnp.full_like(x, 7), _rows(previous, chosen))
  result = train.ClientResult(_rows(algorithm.client_models(state), chosen), new_opt,
                              jnp.ones(3))
  inputs = engine.RoundInputs(None, (chosen,), jnp.asarray(np.arange(M) != ABSENT),
                          jnp.zeros(M, bool), KEY)
  groups = groups_lib.as_groups(algorithm, MODEL, M)
  (opt_state,) = engine._stored_opt_states(groups, (previous,), inputs.chosen, (result,))
  _, losses = engine._placed(groups, groups.algorithm.client_models(state), inputs.chosen,
                             (result.params,), (result.loss,))
  for a, b in zip(jax.tree.leaves(opt_state), jax.tree.leaves(previous)):
    np.testing.assert_array_equal(a[ABSENT], b[ABSENT])
    np.testing.assert_array_equal(a[np.asarray(chosen)], 7)
  np.testing.assert_array_equal(losses, [1, 0, 1, 1])


def _adam_ref(grads, lr, b1, b2=0.999, eps=1e-8):
  m = v = 0.0
  updates = []
  for t, g in enumerate(grads, 1):
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    updates.append(-lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps))
  return updates


def _momentum_ref(grads, lr, momentum):
  trace, updates = 0.0, []
  for g in grads:
    trace = g + momentum * trace
    updates.append(-lr * trace)
  return updates


@pytest.mark.parametrize("name", NAMES)
def test_optimizer_two_steps_by_hand(name):
  """FedClassAvg: its own Adam(lr, betas (0.5, 0.999)); the others: the shared SGD
  base (lr, momentum). The `PHASED` train only their first part in these steps:
  FedRep's head with the SGD base, FedALA's weights with SGD at step eta,
  projected on [0, 1]."""
  algorithm = _algorithm(name)
  grads = [np.array([0.5, -2.0, 1e-3]), np.array([-1.0, 0.25, 3.0])]
  phased = SPECS[name].phased
  if phased:
    as_params = lambda x: _phased_params(name, x, x)
  else:
    as_params = lambda x: ({"w": {"a": x}, "v": {"a": x}}
                           if SPECS[name].trains == "pair" else {"a": x})
  params = as_params(jnp.zeros(3))
  opt_state = algorithm.optimizer.init(params)
  if _own_adam(name):
    expected = _adam_ref(grads, ADAM_LR, ADAM_B1)
  else:
    expected = REFERENCES[name].first_steps(name, grads)
  for g, want in zip(grads, expected):
    updates, opt_state = algorithm.optimizer.update(
        as_params(jnp.asarray(g, jnp.float32)), opt_state, params)
    if phased:
      updates, frozen = _phase_parts(name, updates)
      np.testing.assert_array_equal(frozen, 0.0)
    for leaf in jax.tree.leaves(updates):
      np.testing.assert_allclose(leaf, want, rtol=1e-5, atol=1e-7)


def _phased_params(name, first, second):
  """A tree of the `PHASED` method `name` with leaves `first` (trained first) and
  `second`: FedALA's weights and delta, or a model's head (the output layer) and
  body."""
  if SPECS[name].trains == "ala":
    return {"weights": {"a": first}, "delta": {"a": second}}
  return {"classifier": {"output": {"a": first}}, "features": {"a": second}}


def _phase_parts(name, tree):
  """`(first, second)` leaves of a `_phased_params` tree."""
  if SPECS[name].trains == "ala":
    return tree["weights"]["a"], tree["delta"]["a"]
  return tree["classifier"]["output"]["a"], tree["features"]["a"]


@pytest.mark.parametrize("name", PHASED)
def test_two_phases_switch_to_the_second_part_with_a_fresh_state(name):
  """After its first steps (2, `KWARGS`) the first part is frozen (zero updates) and
  the second part trains with its own optimizer state, untouched so far: the SGD
  base's momentum restarts at the third step's gradient."""
  algorithm = _algorithm(name)
  grads = [np.array([0.5, -2.0, 1e-3]), np.array([-1.0, 0.25, 3.0]),
           np.array([2.0, 1.0, -0.5]), np.array([0.1, -0.3, 0.7])]
  params = _phased_params(name, jnp.full(3, 0.5), jnp.zeros(3))
  opt_state = algorithm.optimizer.init(params)
  second = _momentum_ref(grads[2:], LR, MOMENTUM)
  for t, g in enumerate(grads):
    g = jnp.asarray(g, jnp.float32)
    updates, opt_state = algorithm.optimizer.update(_phased_params(name, g, g),
                                                    opt_state, params)
    first_update, second_update = _phase_parts(name, updates)
    if t < 2:
      np.testing.assert_array_equal(second_update, 0.0)
    else:
      np.testing.assert_array_equal(first_update, 0.0)
      np.testing.assert_allclose(second_update, second[t - 2], rtol=1e-5, atol=1e-7)


def _scaled_to_norm(tree, norm):
  total = np.sqrt(sum(np.sum(np.square(x)) for x in jax.tree.leaves(_np(tree))))
  return jax.tree.map(lambda x: x * (norm / total), tree)


def test_feddwa_clips_each_model_of_its_pair_separately():
  """`--grad-clip c`: `w` and `v` are two models, each clipped to norm c (issue 11)."""
  optimizer = _algorithm("feddwa", grad_clip=1.0, lr=1.0, momentum=0.0).optimizer
  model = _rows(INIT, 0)
  grads = {"w": _scaled_to_norm(_rows(TRAINED, 1), 10.0),
           "v": _scaled_to_norm(_rows(TRAINED, 2), 0.5)}
  pair = {"w": model, "v": model}
  updates, _ = optimizer.update(grads, optimizer.init(pair), pair)
  expected = {"w": jax.tree.map(lambda g: -g / 10.0, grads["w"]),   # clipped to 1
              "v": jax.tree.map(lambda g: -g, grads["v"])}          # below the clip
  ref.assert_tree_close(updates, expected, rtol=1e-5, atol=1e-6)


def test_grad_clip_of_a_single_model_uses_its_global_norm():
  optimizer = _algorithm("fedrema", grad_clip=2.0, lr=1.0, momentum=0.0).optimizer
  model = _rows(INIT, 0)
  grads = _scaled_to_norm(_rows(TRAINED, 1), 8.0)
  updates, _ = optimizer.update(grads, optimizer.init(model), model)
  ref.assert_tree_close(updates, jax.tree.map(lambda g: -g / 4.0, grads), rtol=1e-5,
                        atol=1e-6)


def test_fedbabu_freezes_the_head_of_w_and_clips_its_body_alone():
  """FedBABU's `w` never moves its head (Algorithm 1), `v` (the fine-tuned copy)
  trains whole; `--grad-clip c` clips `w`'s body and `v` each to norm c."""
  optimizer = _algorithm("fedbabu", grad_clip=1.0, lr=1.0, momentum=0.0).optimizer
  model = _rows(INIT, 0)
  head, body = _split_output(_rows(TRAINED, 1))
  grads = {"w": _with_output(_scaled_to_norm(body, 10.0),
                             jax.tree.map(lambda x: 100.0 * x, head)),
           "v": _scaled_to_norm(_rows(TRAINED, 2), 0.5)}
  pair = {"w": model, "v": model}
  updates, _ = optimizer.update(grads, optimizer.init(pair), pair)
  body_updates = jax.tree.map(lambda g: -g / 10.0, _split_output(grads["w"])[1])
  expected = {"w": _with_output(body_updates, jax.tree.map(jnp.zeros_like, head)),
              "v": jax.tree.map(lambda g: -g, grads["v"])}
  ref.assert_tree_close(updates, expected, rtol=1e-5, atol=1e-6)


def test_fedper_personalizes_the_classifier_by_default():
  """Without `personal`, FedPer's personalization layers are pflax's classifier
  (every Dense layer after the features); a selector of no layer or of every layer
  is refused."""
  optimizer = simulate.client_optimizer("sgd", LR, MOMENTUM)
  fedper = algorithms.fedper(MODEL, optimizer)
  state = fedper.server_update(_init(fedper), TRAINED, jnp.ones(M, bool), KEY)
  up = _np(TRAINED)
  features = _broadcast(ref.fedavg_ref(up["features"], N.astype(np.float64)), M)
  _assert_evaluated(fedper, state, {"personalized": {"features": features,
                                                     "classifier": up["classifier"]}})
  for personal in (lambda path, leaf: False, lambda path, leaf: True):
    with pytest.raises(ValueError, match="personal selects"):
      _init(algorithms.fedper(MODEL, optimizer, personal=personal))


# -------------------------------------------------------------- server steps


def _groups(name):
  """The engine's form of the algorithm, aggregating with the compiled `_server_update`."""
  algorithm = _algorithm(name)._replace(server_update=_server_update(name))
  return groups_lib.as_groups(algorithm, MODEL, M)


def _plan(groups, participation=1.0, num_clients=M):
  """A plan of one run of `groups`, without faults."""
  return engine.Plan(build=lambda value: groups, num_clients=num_clients,
                     participation=participation, fault_fraction=0.0, local_epochs=1,
                     batch_size=2, strategy="vmap")


def _round_outputs(name):
  """The engine's server step of one run after local training (`round_outputs`)."""
  groups = _groups(name)

  def step(carry, inputs, result):
    (state, (opt,)), metrics = engine.round_outputs(
        _plan(groups), groups, engine.Carry(carry[0], (carry[1],)), inputs, (result,))
    return (state, opt), metrics
  return step


def _round_inputs(name, participation, num_clients, carry, fed, t):
  """The engine's round inputs of one run (seed 0)."""
  groups = _groups(name)
  return engine.round_inputs(_plan(groups, participation, num_clients), groups,
                             engine.Carry(carry[0], (carry[1],)), (fed,),
                             jnp.int32(0), jnp.int32(t))


def _server_step(name, trained, mask):
  algorithm = _algorithm(name)
  state = _init(algorithm)
  return algorithm, _server_update(name)(state, trained, jnp.asarray(mask), KEY)


@pytest.mark.parametrize("name", NAMES)
def test_evaluate_after_a_full_round(name):
  """What each algorithm evaluates: FedDWA's personalized model is `v` (its exclusive
  models under their own name), FedClassAvg's is its own features and own classifier
  (the averaged classifier is `global`), FedAvg-like methods hold one global model."""
  upload = _upload(name, TRAINED)
  mask = np.ones(M, bool)
  algorithm, state = _server_step(name, upload, mask)
  _assert_evaluated(algorithm, state, _expected(name, INIT, upload, N, mask))


def _absent_upload(name, upload):
  """Client ABSENT did not take part: its entry is the model it would have started
  from (`client_outputs`)."""
  algorithm = _algorithm(name)
  start = algorithm.client_models(_init(algorithm))
  return _choose(np.arange(M) != ABSENT, upload, start)


@pytest.mark.parametrize("name", NAMES)
def test_server_step_ignores_absent_clients(name):
  """Participation < 1: the absent client's state is unchanged (FedReMa: it still
  receives the averaged features) and its model is nobody's peer or summand."""
  upload = _upload(name, TRAINED)
  mask = np.arange(M) != ABSENT
  algorithm, state = _server_step(name, _absent_upload(name, upload), mask)
  _assert_evaluated(algorithm, state, _expected(name, INIT, upload, N, mask))


def test_moon_keeps_each_participant_model_as_its_previous_one():
  """`z_prev` comes from the client's model after its latest local training: the
  participants' uploads; the absent client keeps its earlier one."""
  mask = np.arange(M) != ABSENT
  _, state = _server_step("moon", _absent_upload("moon", TRAINED), mask)
  ref.assert_tree_close(state.previous, _where(mask, TRAINED, INIT), rtol=0, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_server_step_falls_back_to_the_previous_state_on_non_finite_upload(name):
  """A client that took part but uploaded NaN is dropped (mask False): its state
  stays the previous one and nothing stored is non-finite (issue 8)."""
  upload = _upload(name, TRAINED)
  mask = np.arange(M) != ABSENT
  poisoned = jax.tree.map(lambda x: x.at[ABSENT].set(jnp.nan), upload)
  algorithm = _algorithm(name)
  state = _init(algorithm)
  # The engine's server step: the unhealthy upload is dropped first.
  state, healthy = engine.server_step(_groups(name), state,
                                      (algorithm.client_models(state),), (poisoned,),
                                      jnp.asarray(mask), KEY, outlier_factor=None)
  np.testing.assert_array_equal(healthy, mask)
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(state))
  _assert_evaluated(algorithm, state, _expected(name, INIT, upload, N, mask))


@pytest.mark.parametrize("name", NAMES)
def test_round_without_healthy_client_keeps_the_state(name):
  """Every upload is NaN: the round changes nothing stored (state and optimizer
  state), although the aggregators return zeros for a global model without weight."""
  algorithm = _algorithm(name)
  state = _init(algorithm)
  previous = _opt_state(algorithm, state)
  inputs = _round_inputs(name, 1.0, M, (state, previous), FED, 0)
  upload = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), _upload(name, TRAINED))
  new_opt = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), previous)
  result = train.ClientResult(upload, new_opt, jnp.ones(M))
  (after, opt_state), metrics = _round_outputs(name)((state, previous), inputs, result)
  assert not np.asarray(metrics.healthy).any()
  chex.assert_trees_all_equal(after, state)
  chex.assert_trees_all_equal(opt_state, previous)


def test_fedrema_non_finite_upload_keeps_the_previous_optimizer_state():
  """FedReMa keeps momentum across rounds: a NaN upload must not store NaN momentum."""
  algorithm = _algorithm("fedrema")
  state = _init(algorithm)
  previous = _dirty(_opt_state(algorithm, state))
  inputs = _round_inputs("fedrema", 1.0, M, (state, previous), FED, 0)
  poison = lambda x: x.at[ABSENT].set(jnp.nan)
  upload = jax.tree.map(poison, _upload("fedrema", TRAINED))
  new_opt = jax.tree.map(lambda x: poison(jnp.full_like(x, 7.0)), previous)
  result = train.ClientResult(upload, new_opt, jnp.ones(M))
  (state, opt_state), metrics = _round_outputs("fedrema")((state, previous), inputs,
                                                          result)
  np.testing.assert_array_equal(metrics.healthy, np.arange(M) != ABSENT)
  for a, b in zip(jax.tree.leaves(opt_state), jax.tree.leaves(previous)):
    np.testing.assert_array_equal(a[ABSENT], b[ABSENT])
    np.testing.assert_array_equal(np.delete(np.asarray(a), ABSENT, axis=0), 7.0)


# ------------------------------------------------------------- padded clients


def _padded_federation(real):
  """The first `real` clients of FED, padded like a sharded sweep's (`pad_clients`)."""
  runs = data.Federation(*(np.asarray(x)[None, :real] for x in FED))
  return data.Federation(*(x[0] for x in federation_lib.pad_clients(runs, M)))


@pytest.mark.parametrize("participation,count", [(1.0, 3), (2 / 3, 2)])
def test_padded_clients_are_never_chosen(participation, count):
  fed = _padded_federation(3)
  np.testing.assert_array_equal(fed.num_samples, [3, 4, 2, 0])
  algorithm = _algorithm("fedavg")
  state = _init(algorithm, fed)
  carry = (state, _opt_state(algorithm, state))
  for t in range(8):
    inputs = _round_inputs("fedavg", participation, 3, carry, fed, t)
    took_part = np.asarray(inputs.took_part)
    assert took_part.sum() == count and not took_part[3]
    if inputs.chosen[0] is not None:
      chosen = np.asarray(inputs.chosen[0])
      assert len(chosen) == count and chosen.max() < 3
      np.testing.assert_array_equal(took_part[chosen], True)


@pytest.mark.parametrize("name", NAMES)
def test_padded_clients_are_neither_aggregated_nor_peers(name):
  """A sweep round on 3 clients padded to 4: the padded client takes no part and
  every real client gets what it would without the padding."""
  fed = _padded_federation(3)
  algorithm = _algorithm(name)
  state = _init(algorithm, fed)
  carry = (state, _opt_state(algorithm, state))
  inputs = _round_inputs(name, 1.0, 3, carry, fed, 0)
  assert inputs.chosen == (None,)
  real = np.arange(M) < 3
  upload = _upload(name, TRAINED)
  # The padded client trains on no sample: its entry is its start model.
  trained = _choose(real, upload, algorithm.client_models(state))
  result = train.ClientResult(trained, inputs.clients[0].opt_state, jnp.ones(M))
  (state, _), metrics = _round_outputs(name)(carry, inputs, result)
  np.testing.assert_array_equal(metrics.took_part, real)
  np.testing.assert_array_equal(metrics.healthy, real)
  _assert_evaluated(algorithm, state,
                    _expected(name, INIT, upload, fed.num_samples, real))


# ------------------------------------- cwFedAvg under partial participation


def _cw_two_rounds(first, second, mask):
  """cwFedAvg's state after a full round uploading `first`, then a round in which
  only `mask` upload `second`."""
  algorithm = _algorithm("cwfedavg")
  step = _server_update("cwfedavg")
  state = step(_init(algorithm), first, jnp.ones(M, bool), KEY)
  return algorithm, step(state, second, jnp.asarray(mask), KEY)


def test_cwfedavg_class_models_sum_over_every_client_that_uploaded():
  """Eq. 6 over all M clients (Alg. 1, line 9): absent clients count with their
  latest upload and their latest p~."""
  second = jax.tree.map(lambda x: 1.5 * x, TRAINED)
  mask = np.arange(M) != ABSENT
  algorithm, state = _cw_two_rounds(TRAINED, second, mask)
  uploads = _where(mask, second, TRAINED)
  out, rest = _split_output(uploads)
  dist = ref.estimate_class_dist_ref(out["kernel"])
  class_models = ref.class_models_ref(out, dist, N.astype(np.float64))
  chex.assert_trees_all_close(_np(state.class_models["classifier"]["output"]),
                              class_models, rtol=1e-5, atol=1e-6)
  personal = ref.personalize_ref(class_models, dist)
  on = np.flatnonzero(mask)
  rest = _broadcast(ref.fedavg_ref(_rows(_split_output(_np(second))[1], on),
                                   N[on].astype(np.float64)), M)
  _assert_evaluated(algorithm, state, {"personalized": _with_output(rest, personal)})


def _holding(params, holder, cls):
  """Output kernels in which only `holder` has a large weight vector for `cls`."""
  out = params["classifier"]["output"]
  scale = np.full((M, 1, K), 1.0)
  scale[:, :, cls] = 1e-3
  scale[holder, :, cls] = 30.0
  return _with_output(params, {**out, "kernel": out["kernel"] * scale})


def test_cwfedavg_class_held_only_by_absent_clients_keeps_its_model():
  """Regression (issue 21): when every holder of class 0 sits out a round, class 0's
  model must not become the average of the participants, which hold none of it
  (their p~ for it is small but never zero); it stays the holder's."""
  holder, cls = ABSENT, 0
  first = _holding(TRAINED, holder, cls)
  second = _holding(jax.tree.map(lambda x: -x, TRAINED), holder, cls)
  mask = np.arange(M) != holder
  _, state = _cw_two_rounds(first, second, mask)
  got = _np(state.class_models["classifier"]["output"])
  holders_layer = _np(first["classifier"]["output"])
  participants = ref.fedavg_ref(_rows(_np(second["classifier"]["output"]),
                                      np.flatnonzero(mask)), N[mask].astype(np.float64))
  for name in ("kernel", "bias"):
    own = holders_layer[name][holder]
    error = np.linalg.norm(got[name][cls] - own) / np.linalg.norm(own)
    old_rule = np.linalg.norm(participants[name] - own) / np.linalg.norm(own)
    assert error < 0.05 < old_rule, (name, error, old_rule)
