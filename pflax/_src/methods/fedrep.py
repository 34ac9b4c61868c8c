"""FedRep (Collins et al., ICML 2021): a shared body, each client's own head."""

from typing import NamedTuple

import chex
import flax.linen as nn
import optax

from pflax._src import algorithm as alg
from pflax._src import fedavg as fedavg_lib
from pflax._src import methods
from pflax._src import parts as parts_lib
from pflax._src import tree as tree_lib
from pflax._src import types
from pflax._src import weights as weights_lib
from pflax._src.methods import common
from pflax._src.methods import phases


class SharedRepresentation(NamedTuple):
  """FedRep's state: the global body (representation) and each client's head.

  Both halves keep the model's structure (`pflax.tree.partition`), with None in
  place of the other half's leaves.

  Attributes:
    body: the global representation `phi` (no client axis).
    heads: `(M, ...)` each client's head `h_i`.
    num_samples: `(M,)` training-set sizes `n_i`.
  """
  body: types.Tree
  heads: types.Stacked
  num_samples: chex.Array


def representation_sharing(model: nn.Module, optimizer: optax.GradientTransformation,
                           *, head_steps: int = 10, head: types.Selector | None = None,
                           parts: parts_lib.Parts | None = None) -> alg.Algorithm:
  """FedRep (Collins et al., "Exploiting Shared Representations for Personalized
  Federated Learning", ICML 2021, Algorithm 1): local heads, averaged body.

  Each round a client trains its own head `h_i` with the received body `phi`
  fixed for `head_steps` steps (Algorithm 1's tau head updates), then the
  body with its new head fixed for the round's remaining steps, both with
  cross-entropy; the server averages the bodies, sample-weighted over the
  participants; heads never leave their clients. Each part has its own
  optimizer state (`phases.two_phases`), fresh every round.

  Args:
    model: the clients' Flax model.
    optimizer: the clients' optimizer (of the head, and of the body).
    head_steps: local steps of the head phase each round (>= 0); a client
      with fewer real steps in the round trains only its head.
    head: selector of the head; None: the output layer (`parts.output`), the
      paper's final linear layer.
    parts: the model's `pflax.models.Parts`; None for pflax's models (read only
      when `head` is None).

  Notes:
    [settled] The engine runs a fixed number of local steps per round, so the
    head phase is a number of steps, not epochs: the authors' code trains the
    head for all local epochs but the last `local_rep_ep` (1), PFLlib for one
    epoch before the body's; `head_steps=10` is about 1.5 of the 5 local epochs
    of pflax-run's digits base (7 steps each). See docs/methods.md#fedrep.
  """
  if head_steps < 0:
    raise ValueError(f"head_steps must be >= 0, got {head_steps}.")
  if head is None:
    head = parts_lib.resolve(model, parts, "representation_sharing").output

  def init(params, class_counts, key):
    del key
    if all(tree_lib.required_selection(params, head, "head")):
      raise ValueError("head selects every layer of the model, which leaves no body "
                       "to share: that is local training "
                       "(pflax.algorithms.local_training).")
    heads, body = tree_lib.partition(params, head)
    return SharedRepresentation(common.first(body), heads,
                                common.sample_counts(class_counts))

  def client_models(state):
    m = state.num_samples.shape[0]
    return tree_lib.combine(state.heads, tree_lib.broadcast(state.body, m))

  def server_update(state, trained, mask, key):
    del key
    heads, body = tree_lib.partition(trained, head)
    return state._replace(
        body=fedavg_lib.fedavg(body, state.num_samples, mask=mask),
        heads=weights_lib.keep_masked(heads, state.heads, mask))

  return alg.Algorithm(
      init=init, client_models=client_models,
      loss=alg.cross_entropy_loss(model),
      optimizer=phases.two_phases(head, optimizer, optimizer, head_steps),
      server_update=server_update,
      evaluate=lambda state: {"personalized": client_models(state)})


METHOD = methods.Method(
    name="fedrep", builder=representation_sharing,
    paper=('Collins et al., "Exploiting Shared Representations for Personalized '
           'Federated Learning", ICML 2021'),
    shares_head=False, default=False)
