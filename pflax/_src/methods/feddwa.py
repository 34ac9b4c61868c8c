"""FedDWA (Electronics 2025): exclusive models mixed by similarity, personalized models."""

from typing import NamedTuple

import flax.linen as nn
import optax

from pflax._src import methods
from pflax._src.aggregators import feddwa as dwa_lib
from pflax._src.core import types
from pflax._src.core import weights as weights_lib
from pflax._src.methods import algorithm as alg
from pflax._src.methods import common


class ExclusiveModels(NamedTuple):
  """FedDWA's state: each client's exclusive model `w` and personalized model `v`."""
  exclusive: types.Stacked
  personal: types.Stacked


def feddwa(model: nn.Module, optimizer: optax.GradientTransformation,
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
  loss = common.proximal_pair_loss(model, lam)

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


METHOD = methods.Method(
    name="feddwa", builder=feddwa,
    paper="FedDWA, Electronics 2025, Sec. 4.2",
    shares_head=False, default=True,
    differentiable=("lr", "alpha", "lam", "temperature"),
    test=methods.TestSpec(kwargs={"alpha": 0.3, "lam": 0.7, "temperature": 0.5},
                          trains="pair"))
