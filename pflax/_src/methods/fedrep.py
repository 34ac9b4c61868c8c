"""FedRep (Collins et al., ICML 2021): a shared body, each client's own head."""

import flax.linen as nn
import optax

from pflax._src import methods
from pflax._src.core import types
from pflax._src.methods import algorithm as alg
from pflax._src.methods import fedper
from pflax._src.methods import phases
from pflax._src.training import parts as parts_lib


def fedrep(model: nn.Module, optimizer: optax.GradientTransformation,
           *, head_steps: int = 10, head: types.Selector | None = None,
           parts: parts_lib.Parts | None = None, robust: str = "none",
           trim_fraction: float = 0.1, num_byzantine: int = 0,
           radius: float = 1.0) -> alg.Algorithm:
  """FedRep (Collins et al., "Exploiting Shared Representations for Personalized
  Federated Learning", ICML 2021, Algorithm 1): local heads, averaged body.

  Each round a client trains its own head `h_i` with the received body `phi`
  fixed for `head_steps` steps (Algorithm 1's tau head updates), then the
  body with its new head fixed for the round's remaining steps, both with
  cross-entropy; the server averages the bodies, sample-weighted over the
  participants; heads never leave their clients. Each part has its own
  optimizer state (`phases.two_phases`), fresh every round. This is FedPer's
  server and state (`fedper` with the head as its
  personalization layers, state `PersonalLayers`: `base` is FedRep's body
  `phi`, `personal` the heads `h_i`) with FedRep's two-phase local training.

  Args:
    model: the clients' Flax model.
    optimizer: the clients' optimizer (of the head, and of the body).
    head_steps: local steps of the head phase each round (>= 0); a client
      with fewer real steps in the round trains only its head.
    head: selector of the head; None: the output layer (`parts.output`), the
      paper's final linear layer.
    parts: the model's `pflax.models.Parts`; None for pflax's models (read only
      when `head` is None).
    robust, trim_fraction, num_byzantine, radius: the rule that aggregates the
      shared body, as FedAvg's (`pflax.algorithms.fedavg`; "none": the
      sample-weighted mean; docs/robustness.md).

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
    head = parts_lib.resolve(model, parts, "fedrep").output
  shared_body = fedper.fedper(model, optimizer, personal=head, robust=robust,
                              trim_fraction=trim_fraction,
                              num_byzantine=num_byzantine, radius=radius)
  return shared_body._replace(
      optimizer=phases.two_phases(head, optimizer, optimizer, head_steps))


METHOD = methods.Method(
    name="fedrep", builder=fedrep,
    paper=('Collins et al., "Exploiting Shared Representations for Personalized '
           'Federated Learning", ICML 2021'),
    shares_head=False, default=False,
    test=methods.TestSpec(kwargs={"head_steps": 2}, phased=True))
