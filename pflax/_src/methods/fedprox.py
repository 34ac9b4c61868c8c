"""FedProx (Li et al. 2020): FedAvg with a proximal term in local training."""

import flax.linen as nn
import optax

from pflax._src import methods
from pflax._src.methods import algorithm as alg
from pflax._src.methods import fedavg
from pflax._src.training import losses


def fedprox(model: nn.Module, optimizer: optax.GradientTransformation, *,
            mu: float = 0.001, robust: str = "none",
            trim_fraction: float = 0.1, max_share: float | None = None,
            clip_norm: float | None = None, num_byzantine: int = 0,
            radius: float = 1.0) -> alg.Algorithm:
  """FedProx (Li et al. 2020): FedAvg with `mu/2 ||w - w_global||^2` in local training.

  Args:
    model: the clients' Flax model.
    optimizer: the clients' optimizer.
    mu: weight of the proximal term (>= 0), 0.001 as run in the cwFedAvg
      paper's Table 5.
    robust: "none" (the sample-weighted mean) or a robust rule of
      `fedavg.ROBUST` (docs/methods.md#robust-options, docs/robustness.md).
    trim_fraction: the trimmed mean's fraction cut at each end, in [0, 0.5).
    max_share: a bound on any client's share of the weights, in (0, 1]
      (`pflax.aggregate.capped_weights`; with robust "none" only).
    clip_norm: each update `w_i - w` clipped to this norm before aggregating
      (`pflax.aggregate.clip_updates`).
    num_byzantine, radius: as in `fedavg`.
  """
  alg.check_range("mu", mu, 0.0)
  fedavg.check_robust(clip_norm)
  ce = alg.cross_entropy_loss(model)

  def loss(params, anchor, batch, key):
    return ce(params, None, batch, key) + mu * losses.proximal(params, anchor)

  return fedavg.global_algorithm(
      optimizer, loss, fedavg.global_aggregator(robust, trim_fraction, max_share,
                                              num_byzantine, radius),
      client_context=fedavg.client_models, clip_norm=clip_norm,
      uploads=alg.everything if robust == "none" else None)


METHOD = methods.Method(
    name="fedprox", builder=fedprox,
    paper='Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020',
    shares_head=False, default=True,
    differentiable=("lr", "mu"),
    test=methods.TestSpec(kwargs={"mu": 0.3}))
