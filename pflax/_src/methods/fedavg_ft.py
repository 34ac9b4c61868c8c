"""FedAvg-FT: FedAvg's global model, personalized by local fine-tuning."""

from typing import NamedTuple

import chex
import flax.linen as nn
import jax.numpy as jnp
import optax

from pflax._src import methods
from pflax._src.core import types
from pflax._src.core import weights as weights_lib
from pflax._src.methods import algorithm as alg
from pflax._src.methods import common
from pflax._src.methods import fedavg


class FineTunedModels(NamedTuple):
  """FedAvg-FT's state (FedBABU's too).

  Attributes:
    global_model: the global model `w` (no client axis).
    tuned: `(M, ...)` each client's latest fine-tuned model.
    has_tuned: `(M,)` whether the client has fine-tuned (trained) at all.
    num_samples: `(M,)` training-set sizes `n_i`.
  """
  global_model: types.Tree
  tuned: types.Stacked
  has_tuned: chex.Array
  num_samples: chex.Array


def init(params: types.Stacked, class_counts: chex.Array,
         key: chex.PRNGKey) -> FineTunedModels:
  """`Algorithm.init`: the common initial model is global, nobody fine-tuned yet."""
  del key
  m = class_counts.shape[0]
  return FineTunedModels(common.first(params), params, jnp.zeros((m,), bool),
                         common.sample_counts(class_counts))


def client_models(state: FineTunedModels) -> types.Stacked:
  """`Algorithm.client_models`: every client's copy of the global model."""
  return common.broadcast_global(state.global_model, state.num_samples)


def keep_tuned(state: FineTunedModels, tuned: types.Stacked,
               mask: chex.Array) -> FineTunedModels:
  """`state` with the fine-tuned models of the clients in `mask` replaced."""
  return state._replace(tuned=weights_lib.keep_masked(tuned, state.tuned, mask),
                        has_tuned=state.has_tuned | mask)


def tuned_or_global(state: FineTunedModels) -> types.Stacked:
  """Each client's latest fine-tuned model, the global model for a client that
  never trained."""
  return weights_lib.keep_masked(state.tuned, client_models(state),
                                 state.has_tuned)


def evaluate(state: FineTunedModels) -> dict[str, types.Stacked]:
  """`Algorithm.evaluate`: the fine-tuned models, and the global model."""
  return {"personalized": tuned_or_global(state), "global": client_models(state)}


def fedavg_ft(model: nn.Module,
              optimizer: optax.GradientTransformation, *, robust: str = "none",
              trim_fraction: float = 0.1, num_byzantine: int = 0,
              radius: float = 1.0) -> alg.Algorithm:
  """FedAvg-FT: FedAvg, each client's personalized model fine-tuned from it locally.

  The baseline of Cheng, Chadha and Duchi, "Fine-tuning is Fine in Federated
  Learning" (arXiv:2108.07313, 2021) and of many personalized-FL tables: train
  one global model by FedAvg (McMahan et al. 2017), then fine-tune it on each
  client's own data. Here each round's local training is the fine-tuning: a
  participant trains the global model `w^t` on its data for the local epochs
  (FedAvg's client step), the server averages the uploads (sample-weighted),
  and each client's personalized model is the model it trained in the latest
  round it took part in, `w^{t_i}` fine-tuned; a client that has never trained
  is evaluated on the global model. `global` is the global model.

  Args:
    model: the clients' Flax model.
    optimizer: the clients' optimizer (of training and fine-tuning alike).
    robust, trim_fraction, num_byzantine, radius: the rule that aggregates
      the uploads, as FedAvg's (`pflax.algorithms.fedavg`; "none": the
      sample-weighted mean; docs/robustness.md).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from pflax import algorithms, models
    >>> ft = algorithms.fedavg_ft(models.MLP(10), optax.sgd(0.05))
    >>> state = ft.init({"a": jnp.zeros((2, 3))}, jnp.array([[1, 0], [2, 2]]), None)
    >>> state = ft.server_update(state, {"a": jnp.array([[1.0] * 3, [4.0] * 3])},
    ...                          jnp.array([True, False]), None)
    >>> models_ = ft.evaluate(state)   # client 1 never trained: the global model
    >>> models_["personalized"]["a"][:, 0], models_["global"]["a"][:, 0]
    (Array([1., 1.], dtype=float32), Array([1., 1.], dtype=float32))

  Notes:
    [settled] Fine-tuning takes the local epochs, batch size and optimizer of
    training, and starts from the global model the client received at the
    start of its latest round (one round behind the newest aggregate); see
    docs/methods.md#fedavg-ft.
  """
  aggregate = fedavg.global_aggregator(robust, trim_fraction, None, num_byzantine,
                                       radius)

  def server_update(state, trained, mask, key):
    del key
    return keep_tuned(state, trained, mask)._replace(
        global_model=aggregate(trained, state.num_samples, mask=mask,
                               reference=state.global_model))

  return alg.Algorithm(
      init=init, client_models=client_models,
      loss=alg.cross_entropy_loss(model), optimizer=optimizer,
      server_update=server_update, evaluate=evaluate)


METHOD = methods.Method(
    name="fedavg_ft", builder=fedavg_ft,
    paper=('Cheng, Chadha, Duchi, "Fine-tuning is Fine in Federated Learning", '
           'arXiv:2108.07313, 2021'),
    shares_head=False, default=False)
