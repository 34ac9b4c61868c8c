"""APFL (Deng, Kamani, Mahdavi, 2020): a mixture of a local and the global model."""

from typing import NamedTuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from pflax._src import methods
from pflax._src.aggregators import fedavg as fedavg_lib
from pflax._src.core import types
from pflax._src.core import weights as weights_lib
from pflax._src.methods import algorithm as alg
from pflax._src.methods import common
from pflax._src.methods import phases


class PersonalMixture(NamedTuple):
  """APFL's state.

  Attributes:
    global_model: the global model `w`.
    personal: `(M, ...)` each client's local model `v_i`.
    alpha: `(M,)` each client's mixing weight `alpha_i` (all `alpha` unless
      adapted).
    num_samples: `(M,)` training-set sizes `n_i`.
  """
  global_model: types.Tree
  personal: types.Stacked
  alpha: chex.Array
  num_samples: chex.Array


def mixture(alpha: chex.Numeric, personal: types.Tree, global_model: types.Tree
            ) -> types.Tree:
  """One client's personalized model `v-bar = alpha v + (1 - alpha) w`."""
  return jax.tree.map(lambda v, w: alpha * v + (1.0 - alpha) * w, personal, global_model)


def _optimizer(optimizer: optax.GradientTransformation, adapt_alpha: bool,
               alpha_lr: float) -> optax.GradientTransformation:
  """`optimizer` for each of `w` and `v`; with `adapt_alpha`, SGD at `alpha_lr`
  projected on [0, 1] for `alpha`."""
  if not adapt_alpha:
    return alg.per_model(optimizer, ("w", "v"))
  labels = lambda trained: {name: jax.tree.map(lambda _, n=name: n, trained[name])
                            for name in ("w", "v", "alpha")}
  alpha_sgd = optax.chain(optax.sgd(alpha_lr), phases.box_projection(0.0, 1.0))
  return optax.partition({"w": optimizer, "v": optimizer, "alpha": alpha_sgd},
                         labels)


def apfl(model: nn.Module, optimizer: optax.GradientTransformation,
         *, alpha: float = 0.5, adapt_alpha: bool = False,
         alpha_lr: float = 0.05) -> alg.Algorithm:
  """APFL (Deng, Kamani, Mahdavi, "Adaptive Personalized Federated Learning",
  arXiv:2003.13461, 2020, Algorithm 1).

  Each client trains `{"w", "v"}` on the same batches, each with its own
  optimizer state: `w` (from the global model) with `CE(w)`, and its local
  model `v` with `CE(alpha v + (1 - alpha) w)`, the gradient reaching `v` only
  through the mixture (`alpha` times the mixture's gradient; `w` is held
  constant in that term). The server averages the `w`s, sample-weighted
  (FedAvg); `v` never leaves its client. A client's personalized model is
  `alpha_i v_i + (1 - alpha_i) w`, with `w` the global model.

  Args:
    model: the clients' Flax model.
    optimizer: the optimizer of each of the two models.
    alpha: the mixing weight in [0, 1] (the paper's experiments use 0.25, 0.5
      and 0.75); 0 is FedAvg. With `adapt_alpha`, every client's initial one.
    adapt_alpha: whether each client also trains its own `alpha_i` (the
      paper's adaptive APFL): the trained tree gets an entry `"alpha"`, whose
      gradient is `<v - w, grad CE(v-bar)>`, stepped by SGD at `alpha_lr` and
      clipped to [0, 1] after every step; it stays the client's.
    alpha_lr: the step of `alpha_i`'s SGD (> 0); Algorithm 1 uses the models'
      learning rate, and 0.05 is pflax-run's.

  Notes:
    [settled] `alpha_lr` is a hyperparameter of its own: a builder cannot read
    an optax optimizer's learning rate. See docs/methods.md#apfl.
  """
  alg.check_range("alpha", alpha, 0.0, 1.0)
  alg.check_range("alpha_lr", alpha_lr, 0.0, open_low=True)
  ce = alg.cross_entropy_loss(model)

  def loss(trained, context, batch, key):
    del context
    weight = trained["alpha"] if adapt_alpha else alpha
    mixed = mixture(weight, trained["v"], jax.lax.stop_gradient(trained["w"]))
    return ce(trained["w"], None, batch, key) + ce(mixed, None, batch, key)

  def client_models(state):
    models = {"w": common.broadcast_global(state.global_model, state.num_samples),
              "v": state.personal}
    return {**models, "alpha": state.alpha} if adapt_alpha else models

  def server_update(state, trained, mask, key):
    del key
    new = state._replace(
        global_model=fedavg_lib.fedavg(trained["w"], state.num_samples, mask=mask),
        personal=weights_lib.keep_masked(trained["v"], state.personal, mask))
    if adapt_alpha:
      new = new._replace(alpha=weights_lib.keep_masked(trained["alpha"], state.alpha,
                                                       mask))
    return new

  def init(params, class_counts, key):
    del key
    m = class_counts.shape[0]
    return PersonalMixture(common.first(params), params,
                           jnp.full((m,), alpha, jnp.float32),
                           common.sample_counts(class_counts))

  def evaluate(state):
    held = common.broadcast_global(state.global_model, state.num_samples)
    return {"personalized": jax.vmap(mixture)(state.alpha, state.personal, held),
            "global": held}

  return alg.Algorithm(
      init=init, client_models=client_models, loss=loss,
      optimizer=_optimizer(optimizer, adapt_alpha, alpha_lr),
      server_update=server_update, evaluate=evaluate, uploads=alg.model_named("w"))


METHOD = methods.Method(
    name="apfl", builder=apfl,
    paper=('Deng, Kamani, Mahdavi, "Adaptive Personalized Federated Learning", '
           'arXiv:2003.13461, 2020'),
    shares_head=False, default=False,
    test=methods.TestSpec(kwargs={"alpha": 0.3}, trains="pair"))
