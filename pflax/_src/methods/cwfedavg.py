"""cwFedAvg (Lee & Choi): class-wise models of some layers, with the WDR."""

from typing import NamedTuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from pflax._src import methods
from pflax._src.aggregators import cwfedavg as cw_lib
from pflax._src.aggregators import fedavg as fedavg_lib
from pflax._src.aggregators import privacy as privacy_lib
from pflax._src.core import tree as tree_lib
from pflax._src.core import types
from pflax._src.core import weights as weights_lib
from pflax._src.methods import algorithm as alg
from pflax._src.methods import common
from pflax._src.training import losses
from pflax._src.training import parts as parts_lib


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

  Under client-level DP `uploads` and `uploaded` keep their initial values:
  the server stores no client's upload (docs/privacy.md#cwfedavg).
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


def cwfedavg(model: nn.Module, optimizer: optax.GradientTransformation, *,
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
  output = parts_lib.resolve(model, parts, "cwfedavg").output
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
    selected, rest = tree_lib.partition(common.first(params), layers)
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
    n = common.sample_counts(state.class_counts)
    selected, rest = tree_lib.partition(trained, layers)
    uploads = weights_lib.keep_masked(selected, state.uploads, mask)
    uploaded = state.uploaded | mask
    new = state._replace(
        class_dist=dist, uploads=uploads, uploaded=uploaded,
        class_models=cw_lib.class_models(uploads, dist, n, mask=uploaded))
    if jax.tree.leaves(rest):
      new = new._replace(rest=fedavg_lib.fedavg(rest, n, mask=mask))
    return new

  def private_update(clip_norm, noise_multiplier, expected_participants):
    """Eq. 6 under client-level DP (`pflax.privacy.dp_class_models`): the
    participants' class-weighted contributions and updates of the other layers,
    clipped jointly, noised, over the fixed `q M / K` and `q M`; the weights
    are each client's own `p~_i` (uniform in place of the private `n_i`), and
    no upload is stored (docs/privacy.md#cwfedavg)."""
    def server_update(state, trained, mask, key):
      dist = state.class_dist
      if class_dist == "estimated":    # Eq. 4, on the client's own kernel
        dist = jnp.where(mask[:, None], cw_lib.estimate_class_dist(kernel(trained)),
                         dist)
      m = state.class_counts.shape[0]
      selected, rest = tree_lib.partition(trained, layers)
      updates = jax.tree.map(lambda u, g: u - g, rest,
                             tree_lib.broadcast(state.rest, m))
      class_models, rest_update = privacy_lib.dp_class_models(
          selected, state.class_models, dist, key, clip_norm, noise_multiplier,
          expected_participants, rest=updates, mask=mask)
      return state._replace(
          class_dist=dist, class_models=class_models,
          rest=jax.tree.map(lambda g, d: (g + d).astype(g.dtype), state.rest,
                            rest_update))
    return server_update

  return alg.Algorithm(
      init=init, client_models=client_models, loss=loss, optimizer=optimizer,
      server_update=server_update,
      evaluate=lambda state: {"personalized": client_models(state)},
      client_context=lambda state: state.class_counts.astype(jnp.float32),
      private_update=private_update)


METHOD = methods.Method(
    name="cwfedavg", builder=cwfedavg,
    paper=('Lee and Choi, "Class-Wise Federated Averaging for Efficient '
           'Personalization"'),
    shares_head=True, default=True,
    differentiable=("lr", "wdr_coef"),
    test=methods.TestSpec(kwargs={"wdr_coef": 2.0}))
