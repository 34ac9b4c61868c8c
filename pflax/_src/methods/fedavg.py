"""FedAvg (McMahan et al. 2017), and the global-model machinery of FedProx and FedSA."""

from collections.abc import Callable
from typing import NamedTuple

import chex
import flax.linen as nn
import optax

from pflax._src import methods
from pflax._src.aggregators import robust as robust_lib
from pflax._src.core import tree as tree_lib
from pflax._src.core import types
from pflax._src.methods import algorithm as alg
from pflax._src.methods import common


class GlobalModel(NamedTuple):
  """One global model and the clients' sample counts (FedAvg, FedProx, FedSA)."""
  model: types.Tree
  num_samples: chex.Array


def broadcast_global(state: GlobalModel) -> types.Stacked:
  """Every client's copy of the global model."""
  return tree_lib.broadcast(state.model, state.num_samples.shape[0])


def global_algorithm(optimizer: optax.GradientTransformation, loss: Callable,
                     aggregate: Callable[..., types.Tree],
                     client_context: Callable = alg.no_context,
                     clip_norm: float | None = None,
                     uploads: Callable | None = None) -> alg.Algorithm:
  """Every client trains the global model; the server aggregates the uploads
  (each update first clipped to norm `clip_norm`, if given); `uploads` as in
  `Algorithm` (for a mean of the uploads: `alg.everything`)."""
  def server_update(state, trained, mask, key):
    del key
    if clip_norm:
      trained = robust_lib.clip_updates(trained, state.model, clip_norm, mask=mask)
    return state._replace(model=aggregate(trained, state.num_samples, mask=mask))

  def evaluate(state):
    held = broadcast_global(state)
    return {"personalized": held, "global": held}

  return alg.Algorithm(
      init=lambda params, class_counts, key: GlobalModel(
          common.first(params), common.sample_counts(class_counts)),
      client_models=broadcast_global, loss=loss, optimizer=optimizer,
      server_update=server_update, evaluate=evaluate, client_context=client_context,
      uploads=uploads)


def check_robust(clip_norm: float | None) -> None:
  """ValueError unless `clip_norm` (the robust options' update clip) is None or > 0."""
  if clip_norm is not None:
    alg.check_range("clip_norm", clip_norm, 0.0, open_low=True)


def fedavg(model: nn.Module, optimizer: optax.GradientTransformation, *,
           robust: str = "none", trim_fraction: float = 0.1,
           max_share: float | None = None,
           clip_norm: float | None = None) -> alg.Algorithm:
  """FedAvg (McMahan et al. 2017): the sample-weighted mean of the trained models.

  Args:
    model: the clients' Flax model.
    optimizer: the clients' optimizer.
    robust: "none" (the sample-weighted mean), "median" or "trimmed_mean"
      (coordinate-wise, unweighted: `pflax.aggregate.median`, `trimmed_mean`);
      docs/methods.md#robust-options.
    trim_fraction: the trimmed mean's fraction cut at each end, in [0, 0.5).
    max_share: a bound on any client's share of the weights, in (0, 1]
      (`pflax.aggregate.capped_weights`; with robust "none" only).
    clip_norm: each update `w_i - w` clipped to this norm before aggregating
      (`pflax.aggregate.clip_updates`).

  Example:
    >>> import optax
    >>> from pflax import algorithms, models
    >>> import jax.numpy as jnp
    >>> fedavg = algorithms.fedavg(models.MLP(10), optax.sgd(0.05))
    >>> state = algorithms.GlobalModel({"w": jnp.ones(3)}, jnp.array([1, 2]))
    >>> fedavg.client_models(state)["w"].shape, sorted(fedavg.evaluate(state))
    ((2, 3), ['global', 'personalized'])
  """
  check_robust(clip_norm)
  return global_algorithm(
      optimizer, alg.cross_entropy_loss(model),
      robust_lib.global_aggregator(robust, trim_fraction, max_share),
      clip_norm=clip_norm, uploads=alg.everything if robust == "none" else None)


METHOD = methods.Method(
    name="fedavg", builder=fedavg,
    paper=('McMahan et al., "Communication-Efficient Learning of Deep Networks '
           'from Decentralized Data", AISTATS 2017'),
    shares_head=True, default=True)
