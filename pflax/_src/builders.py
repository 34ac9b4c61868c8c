"""The eight algorithms of pflax-run as builders with keyword hyperparameters.

Each builder takes the Flax model, the clients' optax optimizer and the
method's own hyperparameters (defaults: the papers', see docs/methods.md) and
returns an `Algorithm` whose state is a NamedTuple of its own. Any float
keyword can be a traced value, so a sweep vmaps over it.
"""

import functools
from collections.abc import Callable
from typing import NamedTuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from pflax._src import algorithm as alg
from pflax._src import cwfedavg as cw_lib
from pflax._src import fedavg as fedavg_lib
from pflax._src import feddwa as dwa_lib
from pflax._src import fedrema as rema_lib
from pflax._src import fedsa as fedsa_lib
from pflax._src import losses
from pflax._src import parts as parts_lib
from pflax._src import robust as robust_lib
from pflax._src import tree as tree_lib
from pflax._src import types
from pflax._src import weights as weights_lib
from pflax._src.data import augment as augment_lib
from pflax._src.methods import apfl as apfl_lib
from pflax._src.methods import ditto as ditto_lib
from pflax._src.methods import fedala as fedala_lib
from pflax._src.methods import fedavg_ft as fedavg_ft_lib
from pflax._src.methods import fedbabu as fedbabu_lib
from pflax._src.methods import fedper as fedper_lib
from pflax._src.methods import fedrep as fedrep_lib
from pflax._src.methods import moon as moon_lib

OUTPUT_LAYER = parts_lib.PFLAX_OUTPUT
"""The output layer (kernel and bias) of pflax's models."""
CLASSIFIER = parts_lib.PFLAX_CLASSIFIER
"""Every Dense layer after the feature extractor of pflax's models."""


def _first(stacked: types.Stacked) -> types.Tree:
  """Client 0's tree: the common initial model."""
  return jax.tree.map(lambda x: x[0], stacked)


def _sample_counts(class_counts: chex.Array) -> chex.Array:
  """`(M,)` training-set sizes `n_i = sum_j n_ij`."""
  return jnp.sum(class_counts, axis=-1)


class ClientModels(NamedTuple):
  """Each client's own model (`local_training`)."""
  params: types.Stacked


def _augmented_cross_entropy(model: nn.Module, view: Callable) -> Callable:
  """CE on one view `view(k1, x)` of the batch, `k1 = split(key)[0]`: the view
  FedClassAvg's CE term sees for the same step key."""
  def loss(params, context, batch, key):
    del context
    x = view(jax.random.split(key)[0], batch.x)
    return losses.cross_entropy(alg.logits(model, params, x), batch.y, batch.mask)
  return loss


def local_training(model: nn.Module, optimizer: optax.GradientTransformation, *,
                   augment: str = "none") -> alg.Algorithm:
  """Local training only: each client keeps its own model, no aggregation.

  Args:
    model: the clients' Flax model.
    optimizer: the clients' optimizer.
    augment: the view each batch is trained on: `"none"` (the images as they are,
      the default), `"translate"` (a random translation) or `"simclr"` (one of
      the SimCLR views FedClassAvg's authors train FedClassAvg on,
      `pflax._src.data.augment.simclr`). FedClassAvg (Jang et al., ICPP 2022)
      compares against a Local baseline trained without augmentation;
      `augment="simclr"` is the baseline with FedClassAvg's views.
  """
  view = augment_lib.view_fn(augment, "local_training's augment")
  loss = (alg.cross_entropy_loss(model) if augment == "none"
          else _augmented_cross_entropy(model, view))

  def server_update(state, trained, mask, key):
    del key
    return ClientModels(weights_lib.keep_masked(trained, state.params, mask))

  return alg.Algorithm(
      init=lambda params, class_counts, key: ClientModels(params),
      client_models=lambda state: state.params,
      loss=loss, optimizer=optimizer,
      server_update=server_update,
      evaluate=lambda state: {"personalized": state.params})


class GlobalModel(NamedTuple):
  """One global model and the clients' sample counts (FedAvg, FedProx, FedSA)."""
  model: types.Tree
  num_samples: chex.Array


def _broadcast_global(state: GlobalModel) -> types.Stacked:
  return tree_lib.broadcast(state.model, state.num_samples.shape[0])


def _global_algorithm(optimizer: optax.GradientTransformation, loss: Callable,
                      aggregate: Callable[..., types.Tree],
                      client_context: Callable = alg.no_context,
                      clip_norm: float | None = None) -> alg.Algorithm:
  """Every client trains the global model; the server aggregates the uploads
  (each update first clipped to norm `clip_norm`, if given)."""
  def server_update(state, trained, mask, key):
    del key
    if clip_norm:
      trained = robust_lib.clip_updates(trained, state.model, clip_norm, mask=mask)
    return state._replace(model=aggregate(trained, state.num_samples, mask=mask))

  def evaluate(state):
    held = _broadcast_global(state)
    return {"personalized": held, "global": held}

  return alg.Algorithm(
      init=lambda params, class_counts, key: GlobalModel(
          _first(params), _sample_counts(class_counts)),
      client_models=_broadcast_global, loss=loss, optimizer=optimizer,
      server_update=server_update, evaluate=evaluate, client_context=client_context)


def _check_robust(clip_norm: float | None) -> None:
  if clip_norm is not None:
    alg.check_range("clip_norm", clip_norm, 0.0, open_low=True)


def federated_averaging(model: nn.Module, optimizer: optax.GradientTransformation, *,
                        robust: str = "none", trim_fraction: float = 0.1,
                        max_share: float | None = None,
                        clip_norm: float | None = None) -> alg.Algorithm:
  """FedAvg (McMahan et al. 2017): the sample-weighted mean of the trained models.

  Args:
    model: the clients' Flax model.
    optimizer: the clients' optimizer.
    robust: "none" (the sample-weighted mean), "median" or "trimmed_mean"
      (coordinate-wise, unweighted: `pflax.aggregate.median`, `trimmed_mean`);
      docs/methods.md#robust-options.
    trim_fraction: the trimmed mean's fraction cut at each end, in [0, 0.5).
    max_share: a bound on any client's share of the weights, in (0, 1]
      (`pflax.aggregate.capped_weights`; with robust "none" only).
    clip_norm: each update `w_i - w` clipped to this norm before aggregating
      (`pflax.aggregate.clip_updates`).

  Example:
    >>> import optax
    >>> from pflax import algorithms, models
    >>> import jax.numpy as jnp
    >>> fedavg = algorithms.federated_averaging(models.MLP(10), optax.sgd(0.05))
    >>> state = algorithms.GlobalModel({"w": jnp.ones(3)}, jnp.array([1, 2]))
    >>> fedavg.client_models(state)["w"].shape, sorted(fedavg.evaluate(state))
    ((2, 3), ['global', 'personalized'])
  """
  _check_robust(clip_norm)
  return _global_algorithm(
      optimizer, alg.cross_entropy_loss(model),
      robust_lib.global_aggregator(robust, trim_fraction, max_share),
      clip_norm=clip_norm)


def federated_proximal(model: nn.Module, optimizer: optax.GradientTransformation, *,
                       mu: float = 0.001, robust: str = "none",
                       trim_fraction: float = 0.1, max_share: float | None = None,
                       clip_norm: float | None = None) -> alg.Algorithm:
  """FedProx (Li et al. 2020): FedAvg with `mu/2 ||w - w_global||^2` in local training.

  Args:
    model: the clients' Flax model.
    optimizer: the clients' optimizer.
    mu: weight of the proximal term (>= 0), 0.001 as run in the cwFedAvg
      paper's Table 5.
    robust: "none" (the sample-weighted mean), "median" or "trimmed_mean"
      (coordinate-wise, unweighted: `pflax.aggregate.median`, `trimmed_mean`);
      docs/methods.md#robust-options.
    trim_fraction: the trimmed mean's fraction cut at each end, in [0, 0.5).
    max_share: a bound on any client's share of the weights, in (0, 1]
      (`pflax.aggregate.capped_weights`; with robust "none" only).
    clip_norm: each update `w_i - w` clipped to this norm before aggregating
      (`pflax.aggregate.clip_updates`).
  """
  alg.check_range("mu", mu, 0.0)
  _check_robust(clip_norm)
  ce = alg.cross_entropy_loss(model)

  def loss(params, anchor, batch, key):
    return ce(params, None, batch, key) + mu * losses.proximal(params, anchor)

  return _global_algorithm(optimizer, loss,
                           robust_lib.global_aggregator(robust, trim_fraction, max_share),
                           client_context=_broadcast_global, clip_norm=clip_norm)


def parameter_skew_averaging(model: nn.Module, optimizer: optax.GradientTransformation,
                             *, cv_threshold: float = 0.2, sim_threshold: float = 0.2,
                             num_mic: int = 4, num_mac: int = 4,
                             clip_norm: float | None = None) -> alg.Algorithm:
  """FedSA: FedAvg's client training, parameter-skew-aware aggregation.

  Args:
    model: the clients' Flax model.
    optimizer: the clients' optimizer.
    cv_threshold: coefficient of variation above which a parameter is
      high-dispersion (> 0).
    sim_threshold: category-agreement linkage above which Macro-Classes merge
      (in [-1, 1]).
    num_mic: Micro-Classes per parameter (>= 2).
    num_mac: Macro-Classes of clients (>= 1).
    clip_norm: each update `w_i - w` clipped to this norm before aggregating
      (`pflax.aggregate.clip_updates`; docs/methods.md#robust-options).
  """
  alg.check_range("cv_threshold", cv_threshold, 0.0)
  _check_robust(clip_norm)
  alg.check_range("sim_threshold", sim_threshold, -1.0, 1.0)
  aggregate = functools.partial(fedsa_lib.fedsa, cv_threshold=cv_threshold,
                                sim_threshold=sim_threshold, num_mic=num_mic,
                                num_mac=num_mac)
  return _global_algorithm(optimizer, alg.cross_entropy_loss(model), aggregate,
                           clip_norm=clip_norm)


class ClassModels(NamedTuple):
  """cwFedAvg's server state.

  Attributes:
    class_models: `(K, ...)` class models of the class-wise layers (the other
      leaves None).
    rest: the FedAvg global model of the other layers (class-wise leaves None).
    class_dist: `(M, K)` class distributions that mix each client's model:
      estimated from its last upload (initially 1/K) or empirical.
    class_counts: `(M, K)` training class counts (the WDR's `p`, and `n_i`).
    uploads: `(M, ...)` each client's latest upload of the class-wise layers
      (its `w_i^L` of Eq. 6; the other leaves None).
    uploaded: `(M,)` whether the client has uploaded at least once.
  """
  class_models: types.Tree
  rest: types.Tree
  class_dist: chex.Array
  class_counts: chex.Array
  uploads: types.Stacked
  uploaded: chex.Array


def _class_wise_layers(layers: types.Selector | str | None,
                       output: types.Selector) -> types.Selector | None:
  """cwFedAvg's class-wise layers: "output" (the output layer), "all" or None
  (every layer), or a selector."""
  if isinstance(layers, str):
    if layers not in ("output", "all"):
      raise ValueError(f"layers must be 'output', 'all' or a selector, got {layers!r}.")
    return output if layers == "output" else None
  return layers


def class_wise_averaging(model: nn.Module, optimizer: optax.GradientTransformation, *,
                         wdr_coef: float = 5.0,
                         layers: types.Selector | str | None = "output",
                         class_dist: str = "estimated",
                         parts: parts_lib.Parts | None = None) -> alg.Algorithm:
  """cwFedAvg with the Weight Distribution Regularizer (Lee & Choi).

  Clients train with `CE + wdr_coef * WDR(W_out, p)` (Eq. 12); the server
  keeps one model per class for the class-wise layers (Eq. 6) and the FedAvg
  model of the others, and gives client i the mix `sum_j p~_ij w_j` (Eq. 7).

  Eq. 6 sums over all M clients: the server keeps each client's latest upload
  of the class-wise layers and its `p~`, and a round's class models are built
  from the participants' new uploads and the absent clients' latest ones
  (clients that never uploaded are left out). With full participation this is
  the average of the round's uploads; with partial participation a class held
  only by absent clients keeps a model built from its holders, instead of one
  averaged from participants that hold none of it (docs/methods.md#cwfedavg).

  Args:
    model: the clients' Flax model.
    optimizer: the clients' optimizer.
    wdr_coef: weight of the WDR (>= 0).
    layers: the class-wise layers: "output" (the output layer, the paper's
      cwFedAvg (Output)), "all" or None (every layer, cwFedAvg (All)), or a
      selector.
    class_dist: "estimated" (`p~` from the uploaded output kernel, Eq. 11,
      initially 1/K) or "empirical" (the clients' class counts).
    parts: the model's `pflax.models.Parts` (its output layer); None for
      pflax's models.
  """
  alg.check_range("wdr_coef", wdr_coef, 0.0)
  output = parts_lib.resolve(model, parts, "class_wise_averaging").output
  layers = _class_wise_layers(layers, output)
  kernel = lambda params: parts_lib.output_kernel(params, output)
  if class_dist not in ("estimated", "empirical"):
    raise ValueError(
        f"class_dist must be 'estimated' or 'empirical', got {class_dist!r}.")
  ce = alg.cross_entropy_loss(model)

  def loss(params, counts, batch, key):
    return (ce(params, None, batch, key)
            + wdr_coef * losses.wdr(kernel(params), counts))

  def init(params, class_counts, key):
    del key
    m, k = class_counts.shape
    dist = (class_counts.astype(jnp.float32) if class_dist == "empirical"
            else jnp.full((m, k), 1.0 / k))
    selected, rest = tree_lib.partition(_first(params), layers)
    return ClassModels(jax.tree.map(lambda x: tree_lib.broadcast(x, k), selected),
                       rest, dist, class_counts, tree_lib.partition(params, layers)[0],
                       jnp.zeros((m,), bool))

  def client_models(state):
    m = state.class_counts.shape[0]
    personal = cw_lib.personalize(state.class_models, state.class_dist)
    return tree_lib.combine(personal, tree_lib.broadcast(state.rest, m))

  def server_update(state, trained, mask, key):
    del key
    dist = state.class_dist
    if class_dist == "estimated":
      estimate = cw_lib.estimate_class_dist(kernel(trained))
      dist = jnp.where(mask[:, None], estimate, dist)
    n = _sample_counts(state.class_counts)
    selected, rest = tree_lib.partition(trained, layers)
    uploads = weights_lib.keep_masked(selected, state.uploads, mask)
    uploaded = state.uploaded | mask
    new = state._replace(
        class_dist=dist, uploads=uploads, uploaded=uploaded,
        class_models=cw_lib.class_models(uploads, dist, n, mask=uploaded))
    if jax.tree.leaves(rest):
      new = new._replace(rest=fedavg_lib.fedavg(rest, n, mask=mask))
    return new

  return alg.Algorithm(
      init=init, client_models=client_models, loss=loss, optimizer=optimizer,
      server_update=server_update,
      evaluate=lambda state: {"personalized": client_models(state)},
      client_context=lambda state: state.class_counts.astype(jnp.float32))


class SharedHead(NamedTuple):
  """FedClassAvg's state: each client's own model and the averaged classifier.

  Attributes:
    params: `(M, ...)` each client's locally trained model (own classifier).
    head: the sample-weighted mean of the clients' classifiers (Eq. 3), a tree
      of the classifier's leaves only (`pflax.tree.selected`).
    num_samples: `(M,)` training-set sizes.
  """
  params: types.Stacked
  head: types.Tree
  num_samples: chex.Array


def classifier_averaging(model: nn.Module, optimizer: optax.GradientTransformation, *,
                         rho: float = 0.1, supcon: bool = True,
                         supcon_temperature: float = 100.0,
                         supcon_base_temperature: float = 0.07,
                         warmup_epochs: int = 1,
                         classifier: types.Selector | None = None,
                         parts: parts_lib.Parts | None = None,
                         augment: str = "translate") -> alg.Algorithm:
  """FedClassAvg (Jang et al.): averaged classifier, SupCon on two views, proximal head.

  Local objective (Eq. 4): `CE(y, f(x')) + SupCon(F(x'), F(x'')) +
  rho/2 sum_tensors mean((C_k - C)^2)`, with C the averaged classifier and x',
  x'' two random views of the batch (`augment`). A client's personalized model is
  its own feature extractor with its own classifier (Algorithm 1's output);
  `global` is the averaged classifier on the client's own features.

  Args:
    model: the clients' Flax model.
    optimizer: the clients' optimizer (the paper: Adam, betas (0.5, 0.999)).
    rho: weight of the proximal term (>= 0; 0 switches it off).
    supcon: whether to add the SupCon term (False: CE on one view plus the
      proximal term, the second view is not drawn; the paper's Table 4
      ablation).
    supcon_temperature, supcon_base_temperature: the SupCon loss's (> 0).
    warmup_epochs: local epochs of every client before round 1 (0: none).
    classifier: selector of the averaged classifier (None: the output layer).
    parts: the model's `pflax.models.Parts` (its output layer and
      representation); None for pflax's models.
    augment: how the views x', x'' are drawn (Eq. 4 leaves it open):
      `"translate"` (two random edge-padded translations, the default),
      `"simclr"` (the authors' code: RandomResizedCrop scale (0.2, 1), flip,
      brightness/contrast/saturation jitter 0.4 with p = 0.8, no hue jitter;
      `pflax._src.data.augment.simclr`) or `"none"` (the batch itself; only
      with `supcon=False`, since SupCon's two views would be equal).

  Notes:
    [settled: authors' code] SupCon acts on the last hidden layer's linear
    output before the classifier's ReLU (pflax models' `representation`, the
    authors' `fcin`); on another model, on `parts.representation`, by default
    the output layer's input. The proximal term is a mean per tensor.
  """
  alg.check_range("rho", rho, 0.0)
  alg.check_range("supcon_temperature", supcon_temperature, 0.0, open_low=True)
  alg.check_range("supcon_base_temperature", supcon_base_temperature, 0.0,
                  open_low=True)
  if warmup_epochs < 0:
    raise ValueError(f"warmup_epochs must be >= 0, got {warmup_epochs}.")
  view = augment_lib.view_fn(augment, "classifier_averaging's augment")
  if augment == "none" and supcon:
    raise ValueError("classifier_averaging's augment='none' needs supcon=False: "
                     "SupCon's two views would both be the batch itself.")
  parts = parts_lib.resolve(model, parts, "classifier_averaging")
  classifier = parts.output if classifier is None else classifier
  representation = parts_lib.representation_fn(model, parts)

  def loss(params, global_head, batch, key):
    k1, k2 = jax.random.split(key)
    view1 = view(k1, batch.x)
    own_head = tree_lib.selected(params, classifier)
    prox = losses.proximal(own_head, global_head, reduce="mean")
    total = (losses.cross_entropy(alg.logits(model, params, view1), batch.y, batch.mask)
             + rho * prox)
    if not supcon:
      return total
    view2 = view(k2, batch.x)
    feats = jnp.concatenate([representation(params, view1),
                             representation(params, view2)])
    labels = jnp.concatenate([batch.y, batch.y])
    valid = jnp.concatenate([batch.mask, batch.mask])
    return total + losses.supcon(feats, labels, supcon_temperature,
                                 supcon_base_temperature, mask=valid)

  def global_heads(state):
    return tree_lib.broadcast(state.head, state.num_samples.shape[0])

  def client_models(state):
    return tree_lib.with_selected(state.params, classifier, global_heads(state))

  def server_update(state, trained, mask, key):
    del key
    heads = tree_lib.selected(trained, classifier)
    return state._replace(
        params=weights_lib.keep_masked(trained, state.params, mask),
        head=fedavg_lib.fedavg(heads, state.num_samples, mask=mask))

  def init(params, class_counts, key):
    del key
    return SharedHead(params, tree_lib.selected(_first(params), classifier),
                      _sample_counts(class_counts))

  warmup = (alg.Warmup(warmup_epochs, lambda state, trained, mask:
                       state._replace(params=trained)) if warmup_epochs else None)
  return alg.Algorithm(
      init=init, client_models=client_models, loss=loss, optimizer=optimizer,
      server_update=server_update,
      evaluate=lambda state: {"personalized": state.params,
                              "global": client_models(state)},
      client_context=global_heads,
      warmup=warmup,
      # Unrolled, the two-view SupCon step compiled in 158 s instead of 13 s
      # and ran 7x slower (MLP on digits, 7 steps): keep the loop rolled.
      unroll=1)


class ExclusiveModels(NamedTuple):
  """FedDWA's state: each client's exclusive model `w` and personalized model `v`."""
  exclusive: types.Stacked
  personal: types.Stacked


def dynamic_weight_averaging(model: nn.Module, optimizer: optax.GradientTransformation,
                             *, alpha: float = 0.2, lam: float = 1.0,
                             temperature: float = 1.0) -> alg.Algorithm:
  """FedDWA: exclusive models by similarity weights, plus a personalized model.

  Each client trains the pair `{"w": exclusive, "v": personalized}` on the same
  batches: `w` with cross-entropy, `v` with cross-entropy plus
  `lam/2 ||v - w_g||^2` anchored at the received exclusive model (Alg. 1), each
  with its own optimizer state. The server mixes the updates of `w` by
  cosine-similarity softmax weights (Eqs. 8-10). Personalized accuracy is
  reported on `v`, the exclusive models' own as `exclusive`.

  Args:
    model: the clients' Flax model.
    optimizer: the optimizer of each of the two models.
    alpha: the weight of a client's own update, in [0, 1].
    lam: the personalized model's proximal weight (>= 0).
    temperature: the softmax temperature (> 0).
  """
  alg.check_range("alpha", alpha, 0.0, 1.0)
  alg.check_range("lam", lam, 0.0)
  alg.check_range("temperature", temperature, 0.0, open_low=True)
  ce = alg.cross_entropy_loss(model)

  def loss(pair, received, batch, key):
    return (ce(pair["w"], None, batch, key) + ce(pair["v"], None, batch, key)
            + lam * losses.proximal(pair["v"], received))

  def server_update(state, trained, mask, key):
    del key
    exclusive = dwa_lib.feddwa(trained["w"], state.exclusive, alpha=alpha,
                               temperature=temperature, mask=mask)
    return ExclusiveModels(
        exclusive, weights_lib.keep_masked(trained["v"], state.personal, mask))

  return alg.Algorithm(
      init=lambda params, class_counts, key: ExclusiveModels(params, params),
      client_models=lambda state: {"w": state.exclusive, "v": state.personal},
      loss=loss, optimizer=alg.per_model(optimizer, ("w", "v")),
      server_update=server_update,
      evaluate=lambda state: {"personalized": state.personal,
                              "exclusive": state.exclusive},
      client_context=lambda state: state.exclusive)


class MatchedClassifiers(NamedTuple):
  """FedReMa's state: each client's model, sample counts, the history map."""
  params: types.Stacked
  num_samples: chex.Array
  history: rema_lib.FedReMaState


def relevant_client_matching(model: nn.Module, optimizer: optax.GradientTransformation,
                             *, delta: float = 0.5, temperature: float = 0.5,
                             parts: parts_lib.Parts | None = None) -> alg.Algorithm:
  """FedReMa (Liang et al.): FedAvg feature extractor, relevance-matched classifiers.

  The classifier is every Dense layer after the feature extractor; soft logits
  (temperature `temperature`) come from one uniform random probe per round;
  each client's classifier is the mean of its most relevant peers' (maximum
  difference segmentation) during the critical co-learning period, then by the
  history map (Eqs. 3-9). The clients' optimizer state is kept across rounds
  (the paper's SGD with momentum).

  Args:
    model: the clients' Flax model.
    optimizer: the clients' optimizer.
    delta: the CCP threshold on the maximum gap, in [0, 1].
    temperature: the soft-logit temperature (> 0).
    parts: the model's `pflax.models.Parts` (its classifier); None for pflax's
      models, whose classifier is every Dense layer after the features.
  """
  alg.check_range("delta", delta, 0.0, 1.0)
  alg.check_range("temperature", temperature, 0.0, open_low=True)
  parts = parts_lib.resolve(model, parts, "relevant_client_matching")
  where = parts_lib.classifier_selector(parts)
  apply_classifier = parts_lib.classifier_fn(parts)

  def server_update(state, trained, mask, key):
    classifiers = tree_lib.selected(trained, where)
    logits = rema_lib.probe_logits(apply_classifier, classifiers, key,
                                   parts_lib.classifier_width(parts, classifiers))
    soft = rema_lib.soft_logits(logits, temperature)
    params, history = rema_lib.fedrema(trained, state.num_samples, soft, state.history,
                                       where=where, delta=delta, mask=mask)
    return state._replace(params=params, history=history)

  return alg.Algorithm(
      init=lambda params, class_counts, key: MatchedClassifiers(
          params, _sample_counts(class_counts),
          rema_lib.fedrema_init(class_counts.shape[0])),
      client_models=lambda state: state.params,
      loss=alg.cross_entropy_loss(model), optimizer=optimizer,
      server_update=server_update,
      evaluate=lambda state: {"personalized": state.params},
      keep_opt_state=True)


BUILDERS: dict[str, Callable[..., alg.Algorithm]] = {
    "local": local_training,
    "fedavg": federated_averaging,
    "fedprox": federated_proximal,
    "cwfedavg": class_wise_averaging,
    "fedclassavg": classifier_averaging,
    "fedsa": parameter_skew_averaging,
    "feddwa": dynamic_weight_averaging,
    "fedrema": relevant_client_matching,
    "fedper": fedper_lib.personalization_layers,
    "ditto": ditto_lib.ditto,
    "fedavg_ft": fedavg_ft_lib.fine_tuned_averaging,
    "fedbabu": fedbabu_lib.body_aggregation,
    "fedrep": fedrep_lib.representation_sharing,
    "apfl": apfl_lib.adaptive_personalization,
    "moon": moon_lib.model_contrastive,
    "fedala": fedala_lib.adaptive_local_aggregation,
}
"""The builders of `pflax-run`'s algorithms by command-line name."""

DEFAULT_ALGORITHMS = ("local", "fedavg", "fedprox", "cwfedavg", "fedclassavg", "fedsa",
                      "feddwa", "fedrema")
"""What `pflax-run` runs without `--algorithms`: the five papers' methods and the
baselines they share (Local, FedAvg, FedProx); the other baselines on request."""
