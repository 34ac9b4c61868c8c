"""FedPer (Arivazhagan et al. 2019): base layers averaged, personal layers local."""

from typing import NamedTuple

import chex
import flax.linen as nn
import optax

from pflax._src import methods
from pflax._src.core import tree as tree_lib
from pflax._src.core import types
from pflax._src.core import weights as weights_lib
from pflax._src.methods import algorithm as alg
from pflax._src.methods import common
from pflax._src.methods import fedavg
from pflax._src.training import parts as parts_lib


class PersonalLayers(NamedTuple):
  """FedPer's state: one global base, each client's personalization layers.

  Both halves keep the model's structure (`pflax.tree.partition`), with None in
  place of the other half's leaves.

  Attributes:
    base: the global base layers `W_B` (no client axis).
    personal: `(M, ...)` each client's personalization layers `W_P`.
    num_samples: `(M,)` training-set sizes `n_i`.
  """
  base: types.Tree
  personal: types.Stacked
  num_samples: chex.Array


def _split(params: types.Tree, personal: types.Selector) -> tuple[types.Tree,
                                                                  types.Tree]:
  """`(personalization layers, base layers)` of a (stacked) model; ValueError
  unless `personal` selects some of its leaves but not all."""
  flags = tree_lib.required_selection(params, personal, "personal")
  if all(flags):
    raise ValueError("personal selects every layer of the model, which leaves no "
                     "base layers to average: that is local training "
                     "(pflax.algorithms.local).")
  return tree_lib.partition(params, personal)


def fedper(model: nn.Module, optimizer: optax.GradientTransformation,
           *, personal: types.Selector | None = None,
           parts: parts_lib.Parts | None = None, robust: str = "none",
           trim_fraction: float = 0.1, num_byzantine: int = 0,
           radius: float = 1.0) -> alg.Algorithm:
  """FedPer: FedAvg of the base layers, personalization layers kept local.

  Arivazhagan et al., "Federated Learning with Personalization Layers",
  arXiv:1912.00818, 2019. Every client trains its whole model, the global base
  `W_B` with its own personalization layers `W_P,i`, with cross-entropy
  (Algorithm 1, client side); the server averages the base layers,
  `W_B = sum_i (n_i / n) W_B,i` over the participants (Algorithm 2, server
  side), and every client holds the new base with its own personalization
  layers, which never leave it.

  Args:
    model: the clients' Flax model.
    optimizer: the clients' optimizer.
    personal: selector of the personalization layers; None: the classifier
      (`parts.classifier`, for pflax's models every Dense layer after the
      feature extractor, `pflax.algorithms.CLASSIFIER`; for another model its
      output layer, `parts.output`).
    parts: the model's `pflax.models.Parts`; None for pflax's models (read only
      when `personal` is None).
    robust, trim_fraction, num_byzantine, radius: the rule that aggregates the
      shared base layers, as FedAvg's (`pflax.algorithms.fedavg`; "none": the
      sample-weighted mean; docs/robustness.md).

  Example:
    >>> import optax
    >>> from pflax import algorithms, models
    >>> fedper = algorithms.fedper(models.MLP(10), optax.sgd(0.05))
    >>> fedper.keep_opt_state
    False

  Notes:
    [settled] A client that did not take part keeps its personalization layers
    and, like everyone, receives the new base (Algorithm 1 downloads `W_B` at
    the start of its next round); see docs/methods.md#fedper.
  """
  if personal is None:
    personal = parts_lib.classifier_selector(
        parts_lib.resolve(model, parts, "fedper"))

  aggregate = fedavg.global_aggregator(robust, trim_fraction, None, num_byzantine,
                                       radius)

  def init(params, class_counts, key):
    del key
    own, base = _split(params, personal)
    return PersonalLayers(common.first(base), own, common.sample_counts(class_counts))

  def client_models(state):
    m = state.num_samples.shape[0]
    return tree_lib.combine(state.personal, tree_lib.broadcast(state.base, m))

  def server_update(state, trained, mask, key):
    del key
    own, base = tree_lib.partition(trained, personal)
    return state._replace(
        base=aggregate(base, state.num_samples, mask=mask, reference=state.base),
        personal=weights_lib.keep_masked(own, state.personal, mask))

  return alg.Algorithm(
      init=init, client_models=client_models,
      loss=alg.cross_entropy_loss(model), optimizer=optimizer,
      server_update=server_update,
      evaluate=lambda state: {"personalized": client_models(state)},
      uploads=(None if robust != "none" else
               lambda trained: [not f for f in tree_lib.selection(trained, personal)]))


METHOD = methods.Method(
    name="fedper", builder=fedper,
    paper=('Arivazhagan et al., "Federated Learning with Personalization Layers", '
           'arXiv:1912.00818, 2019'),
    shares_head=False, default=False,
    test=methods.TestSpec(kwargs={"personal": common.OUTPUT_LAYER}))
