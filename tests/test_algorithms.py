"""Each algorithm's pieces against hand computations and `references.py`.

For all eight algorithms: the local loss value on a fixed batch, the optimizer
and its state's lifecycle (fresh each round, or kept by FedReMa), the models
`evaluate` returns, and the server step when a client is absent, uploads
non-finite parameters, or is padding (the sharded sweep's empty clients).

A tiny MLP (16 -> 4 -> 3 -> 3) on constant 4x4 images keeps everything fast;
constant images make FedClassAvg's random translations the identity, so its
two views equal the input and its loss has a closed form.
"""

import functools

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
N = np.array([3, 4, 2, 4])          # training samples per client
ABSENT = 1                          # the client left out of the partial rounds
# Every method hyperparameter away from its default, so a wrongly wired one shows.
LR, MOMENTUM = 0.05, 0.9                      # the shared SGD base
ADAM_LR, ADAM_B1 = 0.01, 0.5                  # FedClassAvg's own Adam
# One MAC cluster: the clients left out join it above sim_threshold
# (docs/methods.md, FedSA).
FEDSA_KWARGS = dict(cv_threshold=0.5, num_mic=3, num_mac=1, sim_threshold=0.3)
KWARGS = {"fedprox": {"mu": 0.3}, "cwfedavg": {"wdr_coef": 2.0},
          "fedclassavg": {"rho": 0.8, "supcon_temperature": 2.0,
                          "supcon_base_temperature": 0.5},
          "fedsa": FEDSA_KWARGS,
          "feddwa": {"alpha": 0.3, "lam": 0.7, "temperature": 0.5},
          "fedrema": {"temperature": 0.7},
          "fedper": {"personal": algorithms.OUTPUT_LAYER}, "ditto": {"lam": 0.3},
          "fedrep": {"head_steps": 2}, "apfl": {"alpha": 0.3},
          "moon": {"mu": 0.7, "temperature": 0.8},
          "fedala": {"eta": 0.6, "ala_steps": 2}}
PAIRS = ("feddwa", "ditto", "fedbabu", "apfl")        # clients training a pair {"w", "v"}
# Clients training one part, then the other (`phases.two_phases`): FedRep's head
# (the output layer) then body, FedALA's weights then model.
PHASED = ("fedrep", "fedala")
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


@functools.cache
def _algorithm(name, grad_clip=None, lr=LR, momentum=MOMENTUM):
  if name == "fedclassavg":
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
  """The stacked upload of each algorithm: the `PAIRS` train a pair `(w, v)`."""
  if name in PAIRS:
    return {"w": trained, "v": jax.tree.map(lambda x: 0.5 * x, trained)}
  if name == "fedala":
    return {"weights": _ala_weights(8), "delta": jax.tree.map(lambda x: 0.5 * x, trained)}
  return _fedrema_upload(trained) if name == "fedrema" else trained


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


def _expected(name, init, trained, num_samples, mask):
  """The models `evaluate` returns after one server step from `init(init)`.

  `trained` is the upload (masked-out rows are ignored), `mask` the clients
  that took part and uploaded finite values. Written from the papers (as
  settled in docs/methods.md) with `references.py`; masked-out clients keep
  their state.
  """
  mask = np.asarray(mask)
  on = np.flatnonzero(mask)
  m = len(mask)
  n = np.asarray(num_samples, np.float64)
  up = _rows(_np(trained), on)
  if name == "local":
    return {"personalized": _where(mask, trained, init)}
  if name in ("fedavg", "fedprox", "fedsa", "moon"):
    if name == "fedsa":
      mean = ref.fedsa_ref(up, n[on], **FEDSA_KWARGS)
    else:
      mean = ref.fedavg_ref(up, n[on])
    return {"personalized": _broadcast(mean, m), "global": _broadcast(mean, m)}
  if name == "cwfedavg":
    out, rest = _split_output(up)
    dist = np.full((m, K), 1.0 / K)       # the initial p~, kept by absent clients
    dist[on] = ref.estimate_class_dist_ref(out["kernel"])
    class_models = ref.class_models_ref(out, dist[on], n[on])
    personal = ref.personalize_ref(class_models, dist)
    rest = _broadcast(ref.fedavg_ref(rest, n[on]), m)
    return {"personalized": _with_output(rest, personal)}
  if name == "fedclassavg":
    own = _where(mask, trained, init)
    head = ref.fedavg_ref(_split_output(up)[0], n[on])
    return {"personalized": own, "global": _with_output(own, _broadcast(head, m))}
  if name == "feddwa":
    exclusive = _np(init)
    mixed = ref.feddwa_ref(up["w"], _rows(_np(init), on), KWARGS["feddwa"]["alpha"],
                           KWARGS["feddwa"]["temperature"])
    exclusive = jax.tree.map(lambda e, x: _set_rows(e, on, x), exclusive, mixed)
    return {"personalized": _where(mask, trained["v"], init), "exclusive": exclusive}
  if name in ("fedper", "fedrep"):   # personal / head: the output layer
    base = _broadcast(ref.fedavg_ref(_split_output(up)[1], n[on]), m)
    return {"personalized": _with_output(base, _split_output(_where(mask, trained,
                                                                    init))[0])}
  if name == "ditto":
    return {"personalized": _where(mask, trained["v"], init),
            "global": _broadcast(ref.fedavg_ref(up["w"], n[on]), m)}
  if name in ("fedavg_ft", "fedbabu"):
    if name == "fedavg_ft":
      tuned, mean = trained, ref.fedavg_ref(up, n[on])
    else:   # the body averaged under the initial head
      head = _split_output(_rows(_np(init), 0))[0]
      tuned, mean = trained["v"], _with_output(ref.fedavg_ref(up["w"], n[on]), head)
    # Clients that never trained are evaluated on the global model.
    return {"personalized": _where(mask, tuned, _broadcast(mean, m)),
            "global": _broadcast(mean, m)}
  if name == "apfl":
    alpha = KWARGS["apfl"]["alpha"]
    mean = _broadcast(ref.fedavg_ref(up["w"], n[on]), m)
    personal = _where(mask, trained["v"], init)
    return {"personalized": jax.tree.map(lambda v, w: alpha * v + (1 - alpha) * w,
                                         personal, mean),
            "global": mean}
  if name == "fedala":
    models = _ala_models(trained, init, _broadcast(_rows(_np(init), 0), m))
    return {"personalized": _where(mask, models, init),
            "global": _broadcast(ref.fedavg_ref(_rows(models, on), n[on]), m)}
  assert name == "fedrema"
  mixed, *_ = ref.fedrema_ref(up, n[on], _fedrema_soft(up), np.zeros((len(on),) * 2),
                              0.0, True, 0.5)
  classifier = jax.tree.map(lambda e, x: _set_rows(e, on, x),
                            _np(init)["classifier"], mixed["classifier"])
  # Alg. 2 line 19: every client receives the averaged feature extractor.
  features = _broadcast(ref.fedavg_ref(up["features"], n[on]), m)
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


def _expected_loss(name, q, client):
  """Client `client`'s local objective at parameters `q`, from `init(INIT)` (FedDWA:
  after one full server step, so that its exclusive and personal models differ)."""
  received = _rows(INIT, 0)    # the global model every client receives at init
  if name in ("local", "fedavg", "fedsa", "fedrema", "fedper", "fedavg_ft", "fedrep"):
    return _ce(q)
  if name == "fedbabu":
    return _ce(q["w"]) + _ce(q["v"])
  if name == "ditto":
    return (_ce(q["w"]) + _ce(q["v"])
            + KWARGS["ditto"]["lam"] * ref.proximal_ref(q["v"], received))
  if name == "apfl":
    alpha = KWARGS["apfl"]["alpha"]
    mixed = jax.tree.map(lambda v, w: alpha * v + (1 - alpha) * w, _np(q["v"]),
                         _np(q["w"]))
    return _ce(q["w"]) + _ce(mixed)
  if name == "moon":    # the global model and the client's previous one: INIT's rows
    z, z_glob, z_prev = (_np_forward(p, BATCH.x)[0]
                         for p in (q, received, _rows(INIT, client)))
    con = ref.model_contrastive_ref(z, z_glob, z_prev, KWARGS["moon"]["temperature"],
                                    np.asarray(BATCH.mask))
    return _ce(q) + KWARGS["moon"]["mu"] * con
  if name == "fedala":  # the local model and the global one: INIT's rows
    return _ce(_ala_models(q, _rows(INIT, client), received))
  if name == "fedprox":
    return _ce(q) + KWARGS["fedprox"]["mu"] * ref.proximal_ref(q, received)
  if name == "cwfedavg":
    p = np.asarray(FED.counts[client], np.float64)
    estimate = ref.estimate_class_dist_ref(_np(q)["classifier"]["output"]["kernel"])
    return _ce(q) + KWARGS["cwfedavg"]["wdr_coef"] * np.linalg.norm(p / p.sum() - estimate)
  if name == "fedclassavg":
    prox = ref.proximal_ref(q["classifier"]["output"], received["classifier"]["output"],
                            reduce="mean")
    return _ce(q) + _supcon(q) + KWARGS["fedclassavg"]["rho"] * prox
  assert name == "feddwa"
  exclusive = _expected("feddwa", INIT, _upload("feddwa", TRAINED), N,
                        np.ones(M, bool))["exclusive"]
  anchor = _rows(exclusive, client)   # the exclusive model the client received
  return (_ce(q["w"]) + _ce(q["v"])
          + KWARGS["feddwa"]["lam"] * ref.proximal_ref(q["v"], anchor))


@pytest.mark.parametrize("name", NAMES)
def test_local_loss_value_by_hand(name):
  """CE (+ FedProx's mu/2 ||w - w_g||^2, cwFedAvg's WDR, FedClassAvg's SupCon and
  rho/2 sum_tensors mean((C - C_g)^2), FedDWA's pair with lambda/2 ||v - w_g||^2)."""
  algorithm = _algorithm(name)
  state = _init(algorithm)
  if name == "feddwa":
    _, state = _server_step(name, _upload(name, TRAINED), np.ones(M, bool))
  context = algorithm.client_context(state)
  point = _random_params(np.random.default_rng(4), M)   # away from every anchor
  if name in PAIRS:
    point = {"w": point, "v": _random_params(np.random.default_rng(5), M)}
  if name == "fedala":
    point = {"weights": _ala_weights(5), "delta": point}
  for client in range(M):
    q = _rows(point, client)
    if name == "fedclassavg":   # SupCon's representation is taken before the ReLU
      assert (_np_forward(q, BATCH.x)[0][np.asarray(BATCH.mask)] < 0).any()
    got = algorithm.loss(q, _rows(context, client) if context is not None else None,
                         BATCH, prng.key(client))
    np.testing.assert_allclose(got, _expected_loss(name, q, client), rtol=2e-5,
                               atol=1e-5)


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
  if name == "fedrema":
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
  _, _, (opt_state,), losses = engine._trained(groups, engine.Carry(state, (previous,)),
                                               inputs, (result,))
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
  if name in PHASED:
    as_params = lambda x: _phased_params(name, x, x)
  else:
    as_params = lambda x: ({"w": {"a": x}, "v": {"a": x}} if name in PAIRS
                           else {"a": x})
  params = as_params(jnp.zeros(3))
  opt_state = algorithm.optimizer.init(params)
  if name == "fedclassavg":
    expected = _adam_ref(grads, ADAM_LR, ADAM_B1)
  elif name == "fedala":   # from W = 0: clip(0 - eta g, 0, 1)
    expected = [np.clip(-KWARGS["fedala"]["eta"] * g, 0.0, 1.0) for g in grads]
  else:
    expected = _momentum_ref(grads, LR, MOMENTUM)
  for g, want in zip(grads, expected):
    updates, opt_state = algorithm.optimizer.update(
        as_params(jnp.asarray(g, jnp.float32)), opt_state, params)
    if name in PHASED:
      updates, frozen = _phase_parts(name, updates)
      np.testing.assert_array_equal(frozen, 0.0)
    for leaf in jax.tree.leaves(updates):
      np.testing.assert_allclose(leaf, want, rtol=1e-5, atol=1e-7)


def _phased_params(name, first, second):
  """A tree of the `PHASED` method `name` with leaves `first` (trained first) and
  `second`."""
  if name == "fedrep":
    return {"classifier": {"output": {"a": first}}, "features": {"a": second}}
  return {"weights": {"a": first}, "delta": {"a": second}}


def _phase_parts(name, tree):
  """`(first, second)` leaves of a `_phased_params` tree."""
  if name == "fedrep":
    return tree["classifier"]["output"]["a"], tree["features"]["a"]
  return tree["weights"]["a"], tree["delta"]["a"]


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


def _round_outputs(name):
  """The engine's server step of one run after local training (`round_outputs`)."""
  groups = _groups(name)

  def step(carry, inputs, result):
    (state, (opt,)), metrics = engine.round_outputs(
        groups, engine.Carry(carry[0], (carry[1],)), inputs, (result,))
    return (state, opt), metrics
  return step


def _round_inputs(name, participation, num_clients, carry, fed, t):
  """The engine's round inputs of one run (seed 0)."""
  groups = _groups(name)
  plan = engine.Plan(build=lambda value: groups, num_clients=num_clients,
                     participation=participation, fault_fraction=0.0, local_epochs=1,
                     batch_size=2, strategy="vmap")
  return engine.round_inputs(plan, groups, engine.Carry(carry[0], (carry[1],)), (fed,),
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
