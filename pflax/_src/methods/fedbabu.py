"""FedBABU (Oh et al., ICLR 2022): body aggregated, head frozen, fine-tuned locally."""

import flax.linen as nn
import jax
import optax

from pflax._src import methods
from pflax._src.core import tree as tree_lib
from pflax._src.core import types
from pflax._src.methods import algorithm as alg
from pflax._src.methods import fedavg
from pflax._src.methods import fedavg_ft
from pflax._src.training import parts as parts_lib


def frozen_head(optimizer: optax.GradientTransformation,
                head: types.Selector) -> optax.GradientTransformation:
  """`optimizer` on each model of the pair `{"w", "v"}` on its own (as
  `pflax.algorithms.per_model`), with the head of `w` frozen: its updates are
  zero whatever `optimizer` does (weight decay included), and a gradient clip
  of `w` sees the body's gradient only."""
  def labels(pair):
    flags = tree_lib.selection(pair["w"], head)
    return {"w": tree_lib.map_selected(lambda _: "head", lambda _: "w", pair["w"],
                                       flags),
            "v": jax.tree.map(lambda _: "v", pair["v"])}
  return optax.partition(
      {"w": optimizer, "v": optimizer, "head": optax.set_to_zero()}, labels)


def fedbabu(model: nn.Module, optimizer: optax.GradientTransformation, *,
            head: types.Selector | None = None,
            parts: parts_lib.Parts | None = None, robust: str = "none",
            trim_fraction: float = 0.1, num_byzantine: int = 0,
            radius: float = 1.0) -> alg.Algorithm:
  """FedBABU: FedAvg of the body under a frozen random head, then fine-tuning.

  Oh, Kim and Yun, "FedBABU: Toward Enhanced Representation for Federated Image
  Classification", ICLR 2022. During federated training the head (the output
  layer) keeps its random initialization and only the body is trained and
  averaged (Algorithm 1: body aggregation, body update); a client's
  personalized model is the global model fine-tuned, head and body, on its own
  data (the paper's evaluation). Each participant trains the pair `{"w": w^t,
  "v": w^t}` on the same batches, each with its own optimizer state: `w` with
  its head frozen (zero updates) and `v`, the fine-tuned copy, whole. The
  server averages the bodies of the `w`s (sample-weighted) under the unchanged
  head; a client's personalized model is its latest `v` (the global model for a
  client that never trained), and `global` is the global model. The state is
  FedAvg-FT's (`pflax.algorithms.FineTunedModels`).

  Args:
    model: the clients' Flax model.
    optimizer: the optimizer of each of the two models (of training and
      fine-tuning alike).
    head: selector of the frozen head; None: the output layer (`parts.output`).
    parts: the model's `pflax.models.Parts`; None for pflax's models (read only
      when `head` is None).
    robust, trim_fraction, num_byzantine, radius: the rule that aggregates
      the bodies, as FedAvg's (`pflax.algorithms.fedavg`; "none": the
      sample-weighted mean; docs/robustness.md).

  Example:
    >>> import optax
    >>> from pflax import algorithms, models
    >>> babu = algorithms.fedbabu(models.MLP(10), optax.sgd(0.05))
    >>> babu.keep_opt_state
    False

  Notes:
    [settled] Fine-tuning runs alongside training, on the same batches for the
    local epochs, from the global model each client received in its latest
    round (the paper fine-tunes the final global model for its own number of
    epochs): local training costs two models per client. See
    docs/methods.md#fedbabu.
  """
  if head is None:
    head = parts_lib.resolve(model, parts, "fedbabu").output
  ce = alg.cross_entropy_loss(model)
  aggregate = fedavg.global_aggregator(robust, trim_fraction, None, num_byzantine,
                                       radius)

  def init(params, class_counts, key):
    if all(tree_lib.required_selection(params, head, "head")):
      raise ValueError("head selects every layer of the model, which leaves no "
                       "body to train.")
    return fedavg_ft.init(params, class_counts, key)

  def client_models(state):
    received = fedavg_ft.client_models(state)
    return {"w": received, "v": received}

  def loss(pair, context, batch, key):
    del context
    return ce(pair["w"], None, batch, key) + ce(pair["v"], None, batch, key)

  def server_update(state, trained, mask, key):
    del key
    _, body = tree_lib.partition(trained["w"], head)
    frozen, received = tree_lib.partition(state.global_model, head)
    body = aggregate(body, state.num_samples, mask=mask, reference=received)
    return fedavg_ft.keep_tuned(state, trained["v"], mask)._replace(
        global_model=tree_lib.combine(frozen, body))

  return alg.Algorithm(
      init=init, client_models=client_models, loss=loss,
      optimizer=frozen_head(optimizer, head),
      server_update=server_update, evaluate=fedavg_ft.evaluate,
      uploads=None if robust != "none" else lambda trained: (
          # leaves of "v" first: dict keys are sorted
          [False] * len(jax.tree.leaves(trained["v"]))
          + [not f for f in tree_lib.selection(trained["w"], head)]))


METHOD = methods.Method(
    name="fedbabu", builder=fedbabu,
    paper=('Oh, Kim, Yun, "FedBABU: Toward Enhanced Representation for Federated '
           'Image Classification", ICLR 2022'),
    shares_head=False, default=False,
    test=methods.TestSpec(trains="pair"))
