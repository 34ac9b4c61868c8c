"""FedALA (Zhang et al., AAAI 2023): adaptive local aggregation before local training."""

from typing import NamedTuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from pflax._src import methods
from pflax._src.aggregators import fedavg as fedavg_lib
from pflax._src.core import tree as tree_lib
from pflax._src.core import types
from pflax._src.core import weights as weights_lib
from pflax._src.methods import algorithm as alg
from pflax._src.methods import common
from pflax._src.methods import phases
from pflax._src.training import parts as parts_lib


def _ala_weights(path: tuple[str, ...], leaf: chex.Array) -> bool:
  """Selects the ALA weights `W` of a client's trained tree `{"weights", "delta"}`."""
  del leaf
  return path[0] == "weights"


class AdaptiveAggregation(NamedTuple):
  """FedALA's state.

  Attributes:
    model: the global model `Theta`.
    local: `(M, ...)` each client's model after its latest local training
      (`Theta_i^{t-1}`; initially the initial model).
    weights: `(M, ...)` each client's ALA weights `W_i` in [0, 1], the leaves of
      the ALA layers only (`pflax.tree.selected`; initially ones).
    num_samples: `(M,)` training-set sizes `n_i`.
  """
  model: types.Tree
  local: types.Stacked
  weights: types.Stacked
  num_samples: chex.Array


def aggregated(weights: types.Tree, local: types.Tree, global_model: types.Tree,
               where: types.Selector) -> types.Tree:
  """FedALA's initial model (Eq. 4-5): `Theta_i + (Theta - Theta_i) * W_i` on the
  layers `where` selects (`weights` holds only those), `Theta` on the others."""
  mixed = jax.tree.map(lambda l, g, w: l + (g - l) * w,
                       tree_lib.selected(local, where),
                       tree_lib.selected(global_model, where), weights)
  return tree_lib.with_selected(global_model, where, mixed)


def trained_model(pair: types.Tree, local: types.Tree, global_model: types.Tree,
                  where: types.Selector) -> types.Tree:
  """A client's model `ALA(W) + delta` from its trained `{"weights", "delta"}`."""
  start = aggregated(pair["weights"], local, global_model, where)
  return jax.tree.map(jnp.add, start, pair["delta"])


def fedala(model: nn.Module, optimizer: optax.GradientTransformation,
           *, eta: float = 1.0, ala_steps: int = 5,
           layers: types.Selector | None = None,
           parts: parts_lib.Parts | None = None) -> alg.Algorithm:
  """FedALA (Zhang et al., "FedALA: Adaptive Local Aggregation for Personalized
  Federated Learning", AAAI 2023, Eqs. 4-6, Algorithm 1).

  Before local training a client aggregates the received global model
  `Theta` into its previous local model `Theta_i` element-wise on the higher
  layers (`layers`), `Theta_i + (Theta - Theta_i) * W_i` (Eq. 5), and takes
  `Theta` on the lower ones (Eq. 4); `W_i` is learned by SGD with step `eta`
  on CE of that model, clipped to [0, 1] after every step (Eq. 6), and kept
  for the next round. Then the client trains the model from there with
  cross-entropy; the server averages the trained models, sample-weighted.

  In the engine a client trains the pair `{"weights": W_i, "delta": delta}`,
  its model being `ALA(W_i) + delta` with `delta` zero at the start of the
  round (`trained_model`), in two phases (`phases.two_phases`): the first
  `ala_steps` steps train `W_i` (plain SGD, step `eta`, projected on [0, 1])
  with `delta` frozen at zero, the remaining steps train `delta` with
  `optimizer`, which is training the model from `ALA(W_i)`: the gradient with
  respect to `delta` is the model's.

  Args:
    model: the clients' Flax model.
    optimizer: the clients' optimizer (of the model).
    eta: the ALA weights' learning rate (> 0), the paper's 1.0.
    ala_steps: local steps learning `W_i` each round (>= 0); their batches are
      the first of the round's random order, a random subset of the client's
      data (the paper's `s` = 80% of it: `ceil(0.8 n_i / B)` batches).
    layers: selector of the higher layers that get ALA (the paper's top `p`
      layers); None: the output layer (`parts.output`), the paper's `p = 1`.
    parts: the model's `pflax.models.Parts`; None for pflax's models (read only
      when `layers` is None).

  Notes:
    [settled] The ALA steps are steps of the round (the model trains for the
    others); in round 1, where a client's local model equals the global one,
    `W_i` gets zero gradients and those steps train nothing, where the
    authors skip ALA. The authors' first effective round trains `W_i` until
    its loss converges; pflax trains `ala_steps` steps every round. See
    docs/methods.md#fedala.
  """
  alg.check_range("eta", eta, 0.0, open_low=True)
  if ala_steps < 0:
    raise ValueError(f"ala_steps must be >= 0, got {ala_steps}.")
  if layers is None:
    layers = parts_lib.resolve(model, parts, "fedala").output
  ce = alg.cross_entropy_loss(model)

  def loss(pair, models, batch, key):
    return ce(trained_model(pair, models["local"], models["global"], layers), None,
              batch, key)

  def init(params, class_counts, key):
    del key
    tree_lib.required_selection(params, layers, "layers")
    return AdaptiveAggregation(
        common.first(params), params,
        jax.tree.map(jnp.ones_like, tree_lib.selected(params, layers)),
        common.sample_counts(class_counts))

  def client_models(state):
    return {"weights": state.weights,
            "delta": jax.tree.map(jnp.zeros_like, state.local)}

  def server_update(state, trained, mask, key):
    del key
    models = jax.vmap(lambda pair, local: trained_model(pair, local, state.model,
                                                        layers))(trained, state.local)
    return state._replace(
        model=fedavg_lib.fedavg(models, state.num_samples, mask=mask),
        local=weights_lib.keep_masked(models, state.local, mask),
        weights=weights_lib.keep_masked(trained["weights"], state.weights, mask))

  ala_optimizer = optax.chain(optax.sgd(eta), phases.box_projection(0.0, 1.0))
  held = lambda state: common.broadcast_global(state.model, state.num_samples)
  return alg.Algorithm(
      init=init, client_models=client_models, loss=loss,
      optimizer=phases.two_phases(_ala_weights, ala_optimizer, optimizer, ala_steps),
      server_update=server_update,
      evaluate=lambda state: {"personalized": state.local, "global": held(state)},
      client_context=lambda state: {"local": state.local, "global": held(state)})


METHOD = methods.Method(
    name="fedala", builder=fedala,
    paper=('Zhang et al., "FedALA: Adaptive Local Aggregation for Personalized '
           'Federated Learning", AAAI 2023'),
    shares_head=False, default=False,
    test=methods.TestSpec(kwargs={"eta": 0.6, "ala_steps": 2}, trains="ala",
                          phased=True))
