"""The eight algorithms as small bundles sharing one training loop.

An `Algorithm` holds pure functions over an explicit state pytree:

* `init(params, fed) -> state` from the initial stacked parameters;
* `start(state) -> stacked` the model each client trains from this round;
* `context(state, fed) -> stacked` per-client constants of the local loss;
* `loss(params, context, batch, key) -> scalar` one client's local objective;
* `server_update(state, trained, mask, key) -> state` the aggregation, where
  `mask` marks the clients that took part and uploaded finite parameters and
  every other client's entry of `trained` is its starting model
  (`drop_unhealthy`), so no update ever reads a non-finite upload;
* `evaluate(state) -> {kind: stacked}` the models to test, by kind (`EVALUATED`).

`client_update` (shared) trains the participating clients with `pflax.train`.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from pflax._src import cwfedavg as cw_lib
from pflax._src import fedavg as fedavg_lib
from pflax._src import feddwa as dwa_lib
from pflax._src import fedrema as rema_lib
from pflax._src import fedsa as fedsa_lib
from pflax._src import losses
from pflax._src import models
from pflax._src import train as train_lib
from pflax._src import tree as tree_lib
from pflax._src import types
from pflax._src import weights as weights_lib

NAMES = ("local", "fedavg", "fedprox", "cwfedavg", "fedclassavg", "fedsa",
         "feddwa", "fedrema")
OUTPUT_LAYER = tree_lib.under("classifier", "output")
CLASSIFIER = tree_lib.under("classifier")
EVALUATED = ("personalized", "global", "exclusive")
"""Kinds of evaluated models, each reported as `<kind>_accuracy`: each client's own
model (always); one global model on every client's test split (FedAvg, FedProx,
FedSA; FedClassAvg's averaged classifier on each client's own features); FedDWA's
exclusive models, one per client and never a global model."""


@dataclasses.dataclass(frozen=True)
class Hyperparameters:
  """Every numeric hyperparameter of the algorithms, as plain values.

  Defaults are the papers' (SPEC §6); the training base (optimizer, learning
  rate, batch size, epochs) is shared by all algorithms in a comparison run,
  except that FedClassAvg trains with Adam (its authors' optimizer, betas
  (0.5, 0.999)) unless `fedclassavg_optimizer` is None: its supervised
  contrastive loss at temperature 100 on unnormalised features is scaled by
  100 / 0.07 and diverged under the common SGD base (9.8% accuracy on digits,
  against 99.8% with Adam).
  """
  optimizer: str = "sgd"
  lr: float = 0.05
  momentum: float = 0.0
  adam_b1: float = 0.9
  grad_clip: float | None = None
  batch_size: int = 10
  local_epochs: int = 5
  fedprox_mu: float = 0.001
  wdr_coef: float = 5.0
  cw_layers: str = "output"
  cw_dist: str = "estimated"
  fedclassavg_rho: float = 0.1
  fedclassavg_optimizer: str | None = "adam"
  fedclassavg_lr: float = 1e-3
  fedclassavg_adam_b1: float = 0.5
  supcon_temperature: float = 100.0
  supcon_base_temperature: float = 0.07
  fedclassavg_warmup_epochs: int = 1
  fedsa_cv_threshold: float = 0.2
  fedsa_sim_threshold: float = 0.2
  fedsa_num_mic: int = 4
  fedsa_num_mac: int = 4
  feddwa_alpha: float = 0.2
  feddwa_lambda: float = 1.0
  feddwa_temperature: float = 1.0
  fedrema_delta: float = 0.5
  fedrema_temperature: float = 0.5


class Federation(NamedTuple):
  """Clients' data as stacked arrays (see `pflax.data.stack_clients`).

  Attributes:
    x, y, valid: training inputs `(M, L, ...)`, labels `(M, L)`, mask `(M, L)`.
    test_x, test_y, test_valid: the clients' test splits.
    counts: `(M, K)` training class counts `n_ij`.
    num_samples: `(M,)` training-set sizes `n_i`.
  """
  x: chex.Array
  y: chex.Array
  valid: chex.Array
  test_x: chex.Array
  test_y: chex.Array
  test_valid: chex.Array
  counts: chex.Array
  num_samples: chex.Array


class Algorithm(NamedTuple):
  """One federated algorithm as pure functions of an explicit state."""
  name: str
  init: Callable[[types.Stacked, Federation, chex.PRNGKey], Any]
  start: Callable[[Any], types.Stacked]
  context: Callable[[Any, Federation], Any]
  loss: train_lib.LossFn
  optimizer: optax.GradientTransformation
  keep_opt_state: bool
  server_update: Callable[[Any, types.Stacked, chex.Array, chex.PRNGKey], Any]
  evaluate: Callable[[Any], dict[str, types.Stacked]]
  unroll: int | bool | None = None


def make_optimizer(hp: Hyperparameters) -> optax.GradientTransformation:
  """The clients' optimizer: SGD (optionally with momentum) or Adam, optional clip."""
  if hp.optimizer == "sgd":
    opt = optax.sgd(hp.lr, momentum=hp.momentum or None)
  elif hp.optimizer == "adam":
    opt = optax.adam(hp.lr, b1=hp.adam_b1, b2=0.999)
  else:
    raise ValueError(f"optimizer must be 'sgd' or 'adam', got {hp.optimizer!r}.")
  if hp.grad_clip:
    opt = optax.chain(optax.clip_by_global_norm(hp.grad_clip), opt)
  return opt


def per_model(optimizer: optax.GradientTransformation,
              names: tuple[str, ...]) -> optax.GradientTransformation:
  """`optimizer` applied to each model of a dict `{name: params}` on its own.

  For a client that trains several models at once (FedDWA's pair `w`, `v`):
  each model gets its own optimizer state and, with `grad_clip`, its gradient
  is clipped by its own global norm, as if it were trained alone.
  """
  labels = lambda models_: {name: jax.tree.map(lambda _, n=name: n, models_[name])
                            for name in names}
  return optax.multi_transform({name: optimizer for name in names}, labels)


def _logits(model: nn.Module, params: types.Tree, x: chex.Array) -> chex.Array:
  return model.apply({"params": params}, x)


def _cross_entropy_loss(model: nn.Module) -> train_lib.LossFn:
  def loss(params, context, batch, key):
    del context, key
    return losses.cross_entropy(_logits(model, params, batch.x), batch.y, batch.mask)
  return loss


def _num_clients(state_tree: types.Stacked) -> int:
  return jax.tree.leaves(state_tree)[0].shape[0]


def _global_algorithm(name: str, model: nn.Module, hp: Hyperparameters,
                      aggregate: Callable[..., types.Tree],
                      loss: train_lib.LossFn | None = None,
                      uses_anchor: bool = False) -> Algorithm:
  """FedAvg-style: every client trains the global model; the server aggregates.

  State: `{"global": tree, "n": (M,) sample counts}`.
  """

  def start(state):
    return tree_lib.broadcast(state["global"], state["n"].shape[0])

  def server_update(state, trained, mask, key):
    del key
    return {**state, "global": aggregate(trained, state["n"], mask=mask)}

  def evaluate(state):
    held = start(state)
    return {"personalized": held, "global": held}

  return Algorithm(
      name=name,
      init=lambda params, fed, key: {"global": jax.tree.map(lambda x: x[0], params),
                                     "n": fed.num_samples},
      start=start,
      context=lambda state, fed: start(state) if uses_anchor else None,
      loss=loss or _cross_entropy_loss(model),
      optimizer=make_optimizer(hp),
      keep_opt_state=False,
      server_update=server_update,
      evaluate=evaluate)


def local(model: nn.Module, hp: Hyperparameters) -> Algorithm:
  """Local training only: each client keeps its own model, no aggregation."""
  return Algorithm(
      name="local",
      init=lambda params, fed, key: {"params": params},
      start=lambda state: state["params"],
      context=lambda state, fed: None,
      loss=_cross_entropy_loss(model),
      optimizer=make_optimizer(hp),
      keep_opt_state=False,
      server_update=lambda state, trained, mask, key: {
          "params": weights_lib.keep_masked(trained, state["params"], mask)},
      evaluate=lambda state: {"personalized": state["params"]})


def fedavg(model: nn.Module, hp: Hyperparameters) -> Algorithm:
  """FedAvg (McMahan et al. 2017): sample-weighted mean of the trained models."""
  return _global_algorithm("fedavg", model, hp, fedavg_lib.fedavg)


def fedprox(model: nn.Module, hp: Hyperparameters) -> Algorithm:
  """FedProx (Li et al. 2020): FedAvg with `mu/2 ||w - w_global||^2` locally."""
  ce = _cross_entropy_loss(model)

  def loss(params, anchor, batch, key):
    return ce(params, None, batch, key) + hp.fedprox_mu * losses.proximal(params, anchor)

  return _global_algorithm("fedprox", model, hp, fedavg_lib.fedavg, loss,
                           uses_anchor=True)


def fedsa(model: nn.Module, hp: Hyperparameters) -> Algorithm:
  """FedSA: FedAvg's client training, parameter-skew-aware aggregation."""
  def aggregate(trained, n, mask):
    return fedsa_lib.fedsa(trained, n, cv_threshold=hp.fedsa_cv_threshold,
                           num_mic=hp.fedsa_num_mic, num_mac=hp.fedsa_num_mac,
                           sim_threshold=hp.fedsa_sim_threshold, mask=mask)
  return _global_algorithm("fedsa", model, hp, aggregate)


def cwfedavg(model: nn.Module, hp: Hyperparameters) -> Algorithm:
  """cwFedAvg with WDR: class models on the server, personalized per client.

  State: class models of the class-wise leaves `(K, ...)`, the FedAvg global of
  the other leaves, the class distributions used for mixing (`p~` estimated
  from the uploaded output kernels, initially 1/K, or the empirical `p`), and
  the sample counts. Layers: "output" (the paper's cwFedAvg (Output)) or "all".
  """
  where = OUTPUT_LAYER if hp.cw_layers == "output" else None
  if hp.cw_layers not in ("output", "all") or hp.cw_dist not in ("estimated", "empirical"):
    raise ValueError("cw_layers must be 'output' or 'all' and cw_dist 'estimated' or "
                     f"'empirical', got {hp.cw_layers!r}, {hp.cw_dist!r}.")
  ce = _cross_entropy_loss(model)

  def loss(params, class_dist, batch, key):
    kernel = params["classifier"]["output"]["kernel"]
    return ce(params, None, batch, key) + hp.wdr_coef * losses.wdr(kernel, class_dist)

  def init(params, fed, key):
    del key
    m, k = fed.counts.shape
    dist = (fed.counts.astype(jnp.float32) if hp.cw_dist == "empirical"
            else jnp.full((m, k), 1.0 / k))
    selected, rest = tree_lib.partition(params, where)
    return {"class_models": jax.tree.map(lambda x: tree_lib.broadcast(x[0], k), selected),
            "rest": jax.tree.map(lambda x: x[0], rest),
            "dist": dist, "n": fed.num_samples}

  def start(state):
    personal = cw_lib.personalize(state["class_models"], state["dist"])
    return tree_lib.combine(personal, tree_lib.broadcast(state["rest"], state["n"].shape[0]))

  def server_update(state, trained, mask, key):
    del key
    dist = state["dist"]
    if hp.cw_dist == "estimated":
      estimate = cw_lib.estimate_class_dist(trained["classifier"]["output"]["kernel"])
      dist = jnp.where(mask[:, None], estimate, dist)
    selected, rest = tree_lib.partition(trained, where)
    new = {**state, "dist": dist,
           "class_models": cw_lib.class_models(selected, dist, state["n"], mask=mask)}
    if jax.tree.leaves(rest):
      new["rest"] = fedavg_lib.fedavg(rest, state["n"], mask=mask)
    return new

  return Algorithm(
      name="cwfedavg", init=init, start=start,
      context=lambda state, fed: fed.counts.astype(jnp.float32),
      loss=loss, optimizer=make_optimizer(hp), keep_opt_state=False,
      server_update=server_update,
      evaluate=lambda state: {"personalized": start(state)})


def augment(key: chex.PRNGKey, x: chex.Array) -> chex.Array:
  """A random translation (pad and crop) of every image in a batch, in JAX."""
  b, h, w, _ = x.shape
  pad = max(1, h // 8)
  padded = jnp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)), mode="edge")
  offsets = jax.random.randint(key, (b, 2), 0, 2 * pad + 1)
  crop = lambda img, o: jax.lax.dynamic_slice(img, (o[0], o[1], 0),
                                              (h, w, img.shape[-1]))
  return jax.vmap(crop)(padded, offsets)


def fedclassavg(model: nn.Module, hp: Hyperparameters) -> Algorithm:
  """FedClassAvg: averaged classifier, SupCon on two views, proximal classifier.

  Local objective (Eq. 4): `CE(y, f(x')) + SupCon(F(x'), F(x'')) +
  rho/2 sum_tensors mean((C_k - C)^2)` with the classifier C the output layer.
  State: each client's parameters (its own, locally trained classifier
  included) and the global classifier. A client's personalized model is its
  own feature extractor with its own classifier (Algorithm 1's output
  `w_k = w_Fk + w_Ck`); `global` is the averaged classifier on the client's
  own features.

  Notes:
    [settled: authors' code] SupCon acts on the last hidden layer's linear
    output `F(x)` before the classifier's ReLU (`model.representation`, the
    authors' `fcin`), not on the post-ReLU input of the output layer.
  """

  def loss(params, global_head, batch, key):
    k1, k2 = jax.random.split(key)
    view1, view2 = augment(k1, batch.x), augment(k2, batch.x)
    logits = _logits(model, params, view1)
    represent = lambda v: model.apply({"params": params}, v, method="representation")
    feats = jnp.concatenate([represent(view1), represent(view2)])
    labels = jnp.concatenate([batch.y, batch.y])
    valid = jnp.concatenate([batch.mask, batch.mask])
    contrast = losses.supcon(feats, labels, hp.supcon_temperature,
                             hp.supcon_base_temperature, mask=valid)
    prox = losses.proximal(params["classifier"]["output"], global_head, reduce="mean")
    return (losses.cross_entropy(logits, batch.y, batch.mask) + contrast
            + hp.fedclassavg_rho * prox)

  def with_head(params, head):
    classifier = {**params["classifier"], "output": head}
    return {**params, "classifier": classifier}

  def start(state):
    m = state["n"].shape[0]
    return with_head(state["params"], tree_lib.broadcast(state["head"], m))

  def server_update(state, trained, mask, key):
    del key
    return fedclassavg_joint_update([state], [trained], [mask])[0]

  if hp.fedclassavg_optimizer is not None:
    hp = dataclasses.replace(hp, optimizer=hp.fedclassavg_optimizer,
                             lr=hp.fedclassavg_lr, adam_b1=hp.fedclassavg_adam_b1)
  return Algorithm(
      name="fedclassavg",
      init=lambda params, fed, key: {
          "params": params, "n": fed.num_samples,
          "head": jax.tree.map(lambda x: x[0], params["classifier"]["output"])},
      start=start,
      context=lambda state, fed: tree_lib.broadcast(state["head"], state["n"].shape[0]),
      loss=loss, optimizer=make_optimizer(hp), keep_opt_state=False,
      server_update=server_update,
      evaluate=lambda state: {"personalized": state["params"], "global": start(state)},
      # Unrolled, the two-view SupCon step compiled in 158 s instead of 13 s
      # and ran 7x slower (MLP on digits, 7 steps): keep the loop rolled.
      unroll=1)


def fedclassavg_joint_update(states: list[Any], trained: list[types.Stacked],
                             masks: list[chex.Array]) -> list[Any]:
  """FedClassAvg's server step over groups of clients with different architectures.

  The groups share only the classifier's shape: their classifiers are joined
  along the client axis (`pflax.tree.concat`), averaged once with sample weights
  (Eq. 3), and the global classifier is given to every group.
  """
  heads = tree_lib.concat([t["classifier"]["output"] for t in trained])
  head = fedavg_lib.fedavg(heads, jnp.concatenate([s["n"] for s in states]),
                           mask=jnp.concatenate(masks))
  return [{**s, "params": weights_lib.keep_masked(t, s["params"], m), "head": head}
          for s, t, m in zip(states, trained, masks)]


def feddwa(model: nn.Module, hp: Hyperparameters) -> Algorithm:
  """FedDWA: exclusive models by similarity weights, plus a personalized model.

  Each client trains the pair `{"w": exclusive, "v": personalized}` on the same
  batches: `w` with cross-entropy, `v` with cross-entropy plus
  `lambda/2 ||v - w_g||^2` anchored at the received exclusive model (Alg. 1).
  Personalized accuracy is reported on `v`; the exclusive models' own accuracy
  is `exclusive` (one model per client, not a global model).
  """
  ce = _cross_entropy_loss(model)

  def loss(pair, received, batch, key):
    return (ce(pair["w"], None, batch, key) + ce(pair["v"], None, batch, key)
            + hp.feddwa_lambda * losses.proximal(pair["v"], received))

  def server_update(state, trained, mask, key):
    del key
    exclusive = dwa_lib.feddwa(trained["w"], state["exclusive"],
                               alpha=hp.feddwa_alpha,
                               temperature=hp.feddwa_temperature, mask=mask)
    return {"exclusive": exclusive,
            "personal": weights_lib.keep_masked(trained["v"], state["personal"], mask)}

  return Algorithm(
      name="feddwa",
      init=lambda params, fed, key: {"exclusive": params, "personal": params},
      start=lambda state: {"w": state["exclusive"], "v": state["personal"]},
      context=lambda state, fed: state["exclusive"],
      loss=loss, optimizer=per_model(make_optimizer(hp), ("w", "v")),
      keep_opt_state=False,
      server_update=server_update,
      evaluate=lambda state: {"personalized": state["personal"],
                              "exclusive": state["exclusive"]})


def fedrema(model: nn.Module, hp: Hyperparameters, input_shape: tuple[int, ...]
            ) -> Algorithm:
  """FedReMa: FedAvg feature extractor, relevance-matched classifiers.

  The classifier is every Dense layer after the convolutions (`classifier`);
  soft logits come from one uniform random probe per round. The optimizer state
  is kept across rounds (the paper's SGD with momentum).
  """
  head = model.head()
  apply_head = lambda params, h: head.apply({"params": params}, h)
  width = models.feature_dim(model, input_shape)

  def server_update(state, trained, mask, key):
    logits = rema_lib.probe_logits(apply_head, trained["classifier"], key, width)
    soft = rema_lib.soft_logits(logits, hp.fedrema_temperature)
    params, rema = rema_lib.fedrema(trained, state["n"], soft, state["rema"],
                                    where=CLASSIFIER, delta=hp.fedrema_delta,
                                    mask=mask)
    return {**state, "params": params, "rema": rema}

  return Algorithm(
      name="fedrema",
      init=lambda params, fed, key: {
          "params": params, "n": fed.num_samples,
          "rema": rema_lib.fedrema_init(_num_clients(params))},
      start=lambda state: state["params"],
      context=lambda state, fed: None,
      loss=_cross_entropy_loss(model), optimizer=make_optimizer(hp),
      keep_opt_state=True, server_update=server_update,
      evaluate=lambda state: {"personalized": state["params"]})


def get_algorithm(name: str, model: nn.Module, hp: Hyperparameters,
                  input_shape: tuple[int, ...]) -> Algorithm:
  """Builds an algorithm by name (one of `NAMES`)."""
  builders = {"local": local, "fedavg": fedavg, "fedprox": fedprox,
              "cwfedavg": cwfedavg, "fedclassavg": fedclassavg, "fedsa": fedsa,
              "feddwa": feddwa}
  if name == "fedrema":
    return fedrema(model, hp, tuple(input_shape))
  if name not in builders:
    raise ValueError(f"algorithm must be one of {NAMES}, got {name!r}.")
  return builders[name](model, hp)


class ClientInputs(NamedTuple):
  """Arguments of a round's trainer for the participating clients."""
  start: types.Stacked
  opt_state: Any
  context: Any
  x: chex.Array
  y: chex.Array
  valid: chex.Array
  keys: chex.Array


def _take(participants: chex.Array | None, tree: Any) -> Any:
  """The participants' rows of every leaf (all rows, ungathered, for None)."""
  if participants is None:
    return tree
  return jax.tree.map(lambda x: x[participants], tree)


def client_inputs(algorithm: Algorithm, state: Any, opt_state: Any, fed: Federation,
                  participants: chex.Array | None, key: chex.PRNGKey) -> ClientInputs:
  """Gathers the participants' starting models, optimizer states and data.

  `participants` is a sorted index array, or None for all clients (no gather:
  with the client axis sharded over devices, nothing moves between them).
  Client i trains with the key `fold_in(key, i)`, whoever else takes part. The
  optimizer state is fresh each round unless the algorithm keeps it.
  """
  start = _take(participants, algorithm.start(state))
  if algorithm.keep_opt_state:
    opt_state = _take(participants, opt_state)
  else:
    opt_state = train_lib.init_opt_state(algorithm.optimizer, start)
  x, y, valid = _take(participants, (fed.x, fed.y, fed.valid))
  ids = jnp.arange(fed.x.shape[0]) if participants is None else participants
  keys = jax.vmap(jax.random.fold_in, (None, 0))(key, ids)
  return ClientInputs(start, opt_state, _take(participants, algorithm.context(state, fed)),
                      x, y, valid, keys)


def client_outputs(algorithm: Algorithm, state: Any, opt_state: Any,
                   participants: chex.Array | None, result: train_lib.ClientResult
                   ) -> tuple[types.Stacked, Any, chex.Array]:
  """Scatters the participants' results back: `(trained, opt_state, losses)`.

  Non-participants' entries of `trained` are their starting models and their
  losses are 0; their optimizer states are kept.
  """
  start = algorithm.start(state)
  if participants is None:
    put = lambda full, part: part
  else:
    put = lambda full, part: jax.tree.map(lambda f, p: f.at[participants].set(p), full,
                                          part)
  if algorithm.keep_opt_state:
    opt_state = put(opt_state, result.opt_state)
  losses_ = put(jnp.zeros(_num_clients(start)), result.loss)
  return put(start, result.params), opt_state, losses_


def drop_unhealthy(algorithm: Algorithm, state: Any, trained: types.Stacked,
                   opt_before: Any, opt_after: Any, healthy: chex.Array
                   ) -> tuple[types.Stacked, Any]:
  """`(trained, opt_state)` with the clients outside `healthy` treated as absent.

  A client that uploaded non-finite values (or did not take part) is given
  back the model it started the round from and its previous optimizer state,
  so the server update never reads its upload and no stored state, whatever
  the algorithm keeps, can become non-finite: the client is dropped from this
  round only.
  """
  trained = weights_lib.keep_masked(trained, algorithm.start(state), healthy)
  return trained, weights_lib.keep_masked(opt_after, opt_before, healthy)


def keep_if_nobody(healthy: chex.Array, new: Any, old: Any) -> Any:
  """`new`, or `old` unchanged when no client is healthy (an empty round).

  Aggregators given no weight return zeros (global models) under `jit`; a
  round in which every upload was dropped must leave the server state as it was.
  """
  anyone = jnp.any(healthy)
  return jax.tree.map(lambda a, b: jnp.where(anyone, a, b), new, old)


def client_update(algorithm: Algorithm, trainer: Callable[..., train_lib.ClientResult],
                  state: Any, opt_state: Any, fed: Federation,
                  participants: chex.Array, key: chex.PRNGKey
                  ) -> tuple[types.Stacked, Any, chex.Array]:
  """Trains the participating clients; returns `(trained, opt_state, losses)`.

  `opt_state` is the stacked state of all clients (see `init_opt_state`); it is
  only read and updated for algorithms that keep it across rounds.
  """
  inputs = client_inputs(algorithm, state, opt_state, fed, participants, key)
  result = trainer(*inputs)
  return client_outputs(algorithm, state, opt_state, participants, result)


def init_opt_state(algorithm: Algorithm, state: Any) -> Any:
  """Every client's optimizer state for the algorithm's starting models."""
  return train_lib.init_opt_state(algorithm.optimizer, algorithm.start(state))
