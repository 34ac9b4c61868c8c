"""MOON (Li, He, Song, CVPR 2021): model-contrastive federated learning."""

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
from pflax._src.training import losses
from pflax._src.training import parts as parts_lib

COSINE_EPS = 1e-8
"""The cosine similarity's floor on `||a|| ||b||` (PyTorch's `CosineSimilarity`)."""


class ContrastiveModels(NamedTuple):
  """MOON's state: the global model, each client's previous local model, `n_i`.

  Attributes:
    model: the global model `w^t`.
    previous: `(M, ...)` each client's model after its latest local training
      (`w_i^{t-1}`; initially the initial model).
    num_samples: `(M,)` training-set sizes `n_i`.
  """
  model: types.Tree
  previous: types.Stacked
  num_samples: chex.Array


def cosine(a: chex.Array, b: chex.Array) -> chex.Array:
  """Row-wise cosine similarity of `(B, D)` arrays, finite gradients at zero rows."""
  dot = jnp.sum(a * b, axis=-1)
  norms = jnp.sum(a * a, axis=-1) * jnp.sum(b * b, axis=-1)
  return dot / jnp.sqrt(jnp.maximum(norms, COSINE_EPS**2))


def model_contrastive_loss(z: chex.Array, z_glob: chex.Array, z_prev: chex.Array,
                           temperature: chex.Numeric,
                           mask: chex.Array | None = None) -> chex.Array:
  """MOON's `l_con` (Eq. 3), averaged over the valid rows of the batch.

  `-log(exp(sim(z, z_glob) / tau) / (exp(sim(z, z_glob) / tau)
  + exp(sim(z, z_prev) / tau)))` per sample, with cosine similarity `sim`.
  """
  pos = cosine(z, z_glob) / temperature
  neg = cosine(z, z_prev) / temperature
  per_sample = jnp.logaddexp(pos, neg) - pos
  valid = jnp.ones(z.shape[:1], bool) if mask is None else mask
  return jnp.sum(jnp.where(valid, per_sample, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


def moon(model: nn.Module, optimizer: optax.GradientTransformation, *,
         mu: float = 1.0, temperature: float = 0.5,
         parts: parts_lib.Parts | None = None) -> alg.Algorithm:
  """MOON (Li, He, Song, "Model-Contrastive Federated Learning", CVPR 2021, Eqs. 3-4,
  Algorithm 1): FedAvg with a model-contrastive term in local training.

  A client's local loss is `CE + mu l_con` (Eq. 4), `l_con` (Eq. 3) pulling
  its representation `z` of each sample towards the received global model's
  `z_glob` and away from its own previous local model's `z_prev` (both
  models frozen), with cosine similarity at temperature `tau`. The server
  averages the trained models, sample-weighted (FedAvg), and keeps each
  participant's trained model as its next `z_prev` model.

  Args:
    model: the clients' Flax model.
    optimizer: the clients' optimizer.
    mu: weight of `l_con` (>= 0; 0 is FedAvg). The paper: 5 on CIFAR-10, 1 on
      CIFAR-100 and Tiny-ImageNet; the default is 1.
    temperature: `tau` (> 0), the paper's 0.5.
    parts: the model's `pflax.models.Parts` (its representation); None for
      pflax's models.

  Notes:
    [settled] `z` is the model's representation (`parts.representation`, for
    pflax's models the last hidden layer before its ReLU, as FedClassAvg's),
    not the output of the paper's extra projection head, which pflax's models
    do not have. See docs/methods.md#moon.
  """
  alg.check_range("mu", mu, 0.0)
  alg.check_range("temperature", temperature, 0.0, open_low=True)
  representation = parts_lib.representation_fn(
      model, parts_lib.resolve(model, parts, "moon"))

  def loss(params, anchors, batch, key):
    del key
    frozen = jax.lax.stop_gradient(anchors)
    con = model_contrastive_loss(
        representation(params, batch.x), representation(frozen["global"], batch.x),
        representation(frozen["previous"], batch.x), temperature, batch.mask)
    ce = losses.cross_entropy(alg.logits(model, params, batch.x), batch.y, batch.mask)
    return ce + mu * con

  held = lambda state: common.broadcast_global(state.model, state.num_samples)

  def server_update(state, trained, mask, key):
    del key
    return state._replace(
        model=fedavg_lib.fedavg(trained, state.num_samples, mask=mask),
        previous=weights_lib.keep_masked(trained, state.previous, mask))

  def evaluate(state):
    return {"personalized": held(state), "global": held(state)}

  return alg.Algorithm(
      init=lambda params, class_counts, key: ContrastiveModels(
          common.first(params), params, common.sample_counts(class_counts)),
      client_models=held, loss=loss, optimizer=optimizer,
      server_update=server_update, evaluate=evaluate,
      client_context=lambda state: {"global": held(state),
                                    "previous": state.previous})


METHOD = methods.Method(
    name="moon", builder=moon,
    paper='Li, He, Song, "Model-Contrastive Federated Learning", CVPR 2021',
    shares_head=False, default=False,
    test=methods.TestSpec(kwargs={"mu": 0.7, "temperature": 0.8}))
