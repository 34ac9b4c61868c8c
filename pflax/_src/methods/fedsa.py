"""FedSA: FedAvg's client training, parameter-skew-aware aggregation."""

import flax.linen as nn
import optax

from pflax._src import methods
from pflax._src.aggregators import fedsa as fedsa_lib
from pflax._src.methods import algorithm as alg
from pflax._src.methods import fedavg


def fedsa(model: nn.Module, optimizer: optax.GradientTransformation,
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
  fedavg.check_robust(clip_norm)
  alg.check_range("sim_threshold", sim_threshold, -1.0, 1.0)

  def aggregate(trained, num_samples, *, mask, reference):
    del reference
    return fedsa_lib.fedsa(trained, num_samples, mask=mask, cv_threshold=cv_threshold,
                           sim_threshold=sim_threshold, num_mic=num_mic,
                           num_mac=num_mac)
  return fedavg.global_algorithm(optimizer, alg.cross_entropy_loss(model), aggregate,
                                 clip_norm=clip_norm)


METHOD = methods.Method(
    name="fedsa", builder=fedsa,
    paper='"FedSA: the Key of Parameter Skew in Federated Learning"',
    shares_head=True, default=True,
    differentiable=("lr",),
    not_differentiable={
        "cv_threshold": "a threshold deciding which parameters are high-dispersion",
        "sim_threshold": "a threshold deciding which Macro-Classes merge"},
    test=methods.TestSpec(
        # One MAC cluster: the clients left out join it above sim_threshold
        # (docs/methods.md, FedSA).
        kwargs={"cv_threshold": 0.5, "num_mic": 3, "num_mac": 1,
                "sim_threshold": 0.3}))
