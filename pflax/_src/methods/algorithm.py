"""What a federated algorithm is to the simulation engine: a few pure functions.

An `Algorithm` is built by a builder with keyword hyperparameters, as an optax
optimizer is (`pflax.algorithms.fedavg(model, optimizer)`), and
holds its state in a NamedTuple of its own. One round of the engine
(`pflax.simulate`) is, for every run:

1. `client_models(state)`: the `(M, ...)` models the clients train from;
2. each participating client trains its model with `loss(params,
   client_context(state)[i], batch, key)` and `optimizer` (`pflax.train`);
3. `server_update(state, trained, mask, key)`: the aggregation. `mask` marks
   the clients that took part and uploaded finite parameters; every other
   client's entry of `trained` is its starting model, so no update ever reads
   a non-finite upload.

`evaluate(state)` returns the models to test by kind (`EVALUATED`). An optional
`warmup` phase trains every client once before round 1 (FedClassAvg).

An algorithm over clients of several architectures (`architectures`, built by
`pflax.algorithms.heterogeneous`) speaks tuples of stacked clients, one
`(m_g, ...)` tree per architecture `g`, wherever a plain one speaks one `(M,
...)` tree.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import chex
import flax.linen as nn
import jax
import numpy as np
import optax

from pflax._src.core import checks
from pflax._src.core import types
from pflax._src.training import adapters
from pflax._src.training import losses
from pflax._src.training import train

EVALUATED = ("personalized", "global", "exclusive")
"""Kinds of evaluated models, each reported as `<kind>_accuracy`: each client's own
model (always); one global model on every client's test split (FedAvg, FedProx,
FedSA; FedClassAvg's averaged classifier on each client's own features); FedDWA's
exclusive models, one per client and never a global model."""

State = Any
"""An algorithm's state: a NamedTuple of arrays (e.g. `GlobalModel`)."""

ServerUpdate = Callable[[State, types.Stacked, chex.Array, chex.PRNGKey], State]
"""`server_update(state, trained, mask, key) -> state` (`Algorithm.server_update`)."""


class Warmup(NamedTuple):
  """Local training of every client before round 1, then `update`.

  Attributes:
    epochs: local epochs of the warm-up.
    update: `update(state, trained, mask) -> state`, with `trained` and `mask`
      as in `Algorithm.server_update`.
    local: whether `update` only keeps each client's own trained model
      (nothing is aggregated, so nothing has to leave a client): client-level
      DP (`pflax.privacy.private`) allows only such a warm-up.
  """
  epochs: int
  update: Callable[[State, types.Stacked, chex.Array], State]
  local: bool = False


def no_context(state: State) -> None:
  """`Algorithm.client_context` of a loss that needs no per-client constants."""
  del state


def round_robin(num_clients: int, num_groups: int) -> tuple[np.ndarray, ...]:
  """Client i in group `i % num_groups`: each non-empty group's client indices.

  >>> [index.tolist() for index in round_robin(5, 2)]
  [[0, 2, 4], [1, 3]]
  """
  return tuple(np.arange(g, num_clients, num_groups)
               for g in range(min(num_groups, num_clients)))


class Architectures(NamedTuple):
  """The architectures of an algorithm over model-heterogeneous clients.

  Client i uses architecture `i % G` (round robin); with M < G clients only
  the first M architectures have any.

  Attributes:
    models: the G Flax models.
    members: each architecture's algorithm, whose `loss`, `optimizer`,
      `keep_opt_state` and `unroll` train its clients.
    shared: selector of the layers that every architecture shares.
  """
  models: tuple[nn.Module, ...]
  members: tuple["Algorithm", ...]
  shared: types.Selector

  def clients(self, num_clients: int) -> tuple[np.ndarray, ...]:
    """Each used architecture's client indices among `num_clients` clients."""
    return round_robin(num_clients, len(self.models))


class Algorithm(NamedTuple):
  """One federated algorithm as pure functions of an explicit state.

  Attributes:
    init: `init(params, class_counts, key) -> state`, from the `(M, ...)`
      initial models (all equal) and the `(M, K)` training class counts.
    client_models: `client_models(state) -> (M, ...)` models to train from.
    loss: one client's local objective (`LossFn`).
    optimizer: the clients' optax optimizer.
    server_update: `server_update(state, trained, mask, key) -> state`, with
      `mask` the bool `(M,)` of the clients aggregated.
    evaluate: `evaluate(state) -> {kind: (M, ...) models}`, kinds from
      `EVALUATED`, "personalized" always present.
    client_context: `client_context(state) -> (M, ...)` per-client constants
      of the loss (None: `no_context`).
    keep_opt_state: whether a client's optimizer state carries over to its
      next round (else it is fresh every round).
    warmup: an optional `Warmup` phase before round 1.
    unroll: `lax.scan` unroll of the local steps (`pflax.train.make_trainer`).
    architectures: None, or the `Architectures` of model-heterogeneous
      clients: then every `(M, ...)` tree above (the `params` of `init`,
      `client_models`, `client_context`, `trained`, `evaluate`'s models) is
      a tuple of one `(m_g, ...)` tree per used architecture, and `mask`
      stays `(M,)`. `loss`, `optimizer`, `keep_opt_state` and `unroll` are
      then architecture 0's: architecture g trains with
      `architectures.members[g]`.
    uploads: what a client uploads for the server to average:
      `uploads(trained) -> one static bool per leaf` of the `(M, ...)` trained
      tree, each such leaf's start being the broadcast global; None when the
      method declares none (client-level DP, `pflax.privacy.private`, refuses
      it).
    private_update: None, or the method's own server step under client-level
      DP: `private_update(clip_norm, noise_multiplier, expected_participants)
      -> server_update`, whose key is the noise's (`pflax.privacy.private`
      uses it in place of the generic noised mean of `uploads`).
  """
  init: Callable[[types.Stacked, chex.Array, chex.PRNGKey], State]
  client_models: Callable[[State], types.Stacked]
  loss: train.LossFn
  optimizer: optax.GradientTransformation
  server_update: ServerUpdate
  evaluate: Callable[[State], dict[str, types.Stacked]]
  client_context: Callable[[State], Any] = no_context
  keep_opt_state: bool = False
  warmup: Warmup | None = None
  unroll: int | bool | None = None
  architectures: Architectures | None = None
  uploads: Callable[[types.Stacked], list[bool]] | None = None
  private_update: Callable[[float, float, float], ServerUpdate] | None = None


def everything(trained: types.Stacked) -> list[bool]:
  """`Algorithm.uploads` of a method whose clients upload their whole model."""
  return [True] * len(jax.tree.leaves(trained))


def model_named(name: str) -> Callable[[types.Stacked], list[bool]]:
  """`Algorithm.uploads` of a method whose clients upload the model `name` of
  a dict of models (Ditto's and APFL's global model `w`)."""
  return lambda trained: [path[0].key == name for path, _ in
                          jax.tree_util.tree_leaves_with_path(trained)]


def logits(model: nn.Module, params: types.Tree, x: chex.Array) -> chex.Array:
  """`model`'s logits for a batch `x` with parameters `params` (`model`: any
  kind `pflax.models.as_model` takes)."""
  return adapters.as_model(model).apply({"params": params}, x)


def cross_entropy_loss(model: nn.Module) -> train.LossFn:
  """The plain local objective: mean cross-entropy over the batch's real samples."""
  def loss(params, context, batch, key):
    del context, key
    return losses.cross_entropy(logits(model, params, batch.x), batch.y, batch.mask)
  return loss


check_range = checks.check_range
"""`pflax._src.core.checks.check_range`: the range check of builders' hyperparameters."""


def per_model(optimizer: optax.GradientTransformation,
              names: tuple[str, ...]) -> optax.GradientTransformation:
  """`optimizer` applied to each model of a dict `{name: params}` on its own.

  For a client that trains several models at once (FedDWA's pair `w`, `v`):
  each model gets its own optimizer state and, with gradient clipping, its
  gradient is clipped by its own global norm, as if it were trained alone.
  """
  labels = lambda models_: {name: jax.tree.map(lambda _, n=name: n, models_[name])
                            for name in names}
  return optax.partition({name: optimizer for name in names}, labels)
