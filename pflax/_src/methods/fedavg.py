"""FedAvg (McMahan et al. 2017), and the global-model machinery of FedProx and FedSA."""

from collections.abc import Callable
from typing import NamedTuple

import chex
import flax.linen as nn
import optax

from pflax._src import methods
from pflax._src.aggregators import byzantine
from pflax._src.aggregators import fedavg as fedavg_lib
from pflax._src.aggregators import robust as robust_lib
from pflax._src.core import checks
from pflax._src.core import types
from pflax._src.methods import algorithm as alg
from pflax._src.methods import common


class GlobalModel(NamedTuple):
  """One global model and the clients' sample counts (FedAvg, FedProx, FedSA)."""
  model: types.Tree
  num_samples: chex.Array


def client_models(state: GlobalModel) -> types.Stacked:
  """`Algorithm.client_models` of the global-model methods: every client's copy of
  the global model (FedProx's client context too)."""
  return common.broadcast_global(state.model, state.num_samples)


def global_algorithm(optimizer: optax.GradientTransformation, loss: Callable,
                     aggregate: Callable[..., types.Tree],
                     client_context: Callable = alg.no_context,
                     clip_norm: float | None = None,
                     uploads: Callable | None = None) -> alg.Algorithm:
  """Every client trains the global model; the server aggregates the uploads
  (each update first clipped to norm `clip_norm`, if given) with
  `aggregate(trained, num_samples, *, mask, reference)`, `reference` the global
  model the clients started from; `uploads` as in `Algorithm` (for a mean of the
  uploads: `alg.everything`)."""

  def server_update(state, trained, mask, key):
    del key
    if clip_norm:
      trained = robust_lib.clip_updates(trained, state.model, clip_norm, mask=mask)
    return state._replace(model=aggregate(trained, state.num_samples, mask=mask,
                                          reference=state.model))

  def evaluate(state):
    held = client_models(state)
    return {"personalized": held, "global": held}

  return alg.Algorithm(
      init=lambda params, class_counts, key: GlobalModel(
          common.first(params), common.sample_counts(class_counts)),
      client_models=client_models, loss=loss, optimizer=optimizer,
      server_update=server_update, evaluate=evaluate, client_context=client_context,
      uploads=uploads)


ROBUST = ("none", "median", "trimmed_mean", "krum", "multi_krum", "bulyan",
          "geometric_median", "centered_clipping")
"""The `robust` options of the global-model builders (docs/robustness.md)."""


def global_aggregator(robust: str = "none", trim_fraction: float = 0.1,
                      max_share: float | None = None, num_byzantine: int = 0,
                      radius: float = 1.0) -> Callable[..., types.Tree]:
  """`aggregate(trained, num_samples, *, mask, reference) -> model` of a
  global-model method: FedAvg (its weights capped at `max_share` if given) or
  one of the robust rules of `ROBUST` (`reference`: the global model the clients
  started from; Krum's distances are taken from it and centered clipping starts
  there).

  Raises:
    ValueError: for a `robust` not in `ROBUST` or options out of range.
  """
  if robust not in ROBUST:
    raise ValueError(f"robust must be one of {ROBUST}, got {robust!r}.")
  if checks.is_concrete(trim_fraction) and not 0 <= trim_fraction < 0.5:
    raise ValueError(f"trim_fraction must be in [0, 0.5), got {trim_fraction!r}.")
  if (max_share is not None and checks.is_concrete(max_share)
      and not 0 < max_share <= 1):
    raise ValueError(f"max_share must be None or in (0, 1], got {max_share!r}.")
  if robust != "none" and max_share is not None:
    raise ValueError(f"max_share bounds FedAvg's weights; robust={robust!r} is "
                     "unweighted: pass one of them.")
  checks.integer_at_least(num_byzantine, "num_byzantine", 0)
  alg.check_range("radius", radius, 0.0, open_low=True)

  def aggregate(trained, num_samples, *, mask=None, reference=None):
    if robust == "median":
      return robust_lib.median(trained, mask=mask)
    if robust == "trimmed_mean":
      return robust_lib.trimmed_mean(trained, trim_fraction=trim_fraction, mask=mask)
    if robust in ("krum", "multi_krum"):
      return byzantine.multi_krum(trained, num_byzantine=num_byzantine,
                                  num_selected=1 if robust == "krum" else None,
                                  reference=reference, mask=mask)
    if robust == "bulyan":
      return byzantine.bulyan(trained, num_byzantine=num_byzantine,
                              reference=reference, mask=mask)
    if robust == "geometric_median":
      return byzantine.geometric_median(trained, num_samples, mask=mask)
    if robust == "centered_clipping":
      return byzantine.centered_clipping(trained, reference, radius=radius, mask=mask)
    if max_share is not None:
      num_samples = robust_lib.capped_weights(num_samples, max_share, mask=mask)
    return fedavg_lib.fedavg(trained, num_samples, mask=mask)
  return aggregate


def check_robust(clip_norm: float | None) -> None:
  """ValueError unless `clip_norm` (the robust options' update clip) is None or > 0."""
  if clip_norm is not None:
    alg.check_range("clip_norm", clip_norm, 0.0, open_low=True)


def fedavg(model: nn.Module, optimizer: optax.GradientTransformation, *,
           robust: str = "none", trim_fraction: float = 0.1,
           max_share: float | None = None,
           clip_norm: float | None = None, num_byzantine: int = 0,
           radius: float = 1.0) -> alg.Algorithm:
  """FedAvg (McMahan et al. 2017): the sample-weighted mean of the trained models.

  Args:
    model: the clients' Flax model.
    optimizer: the clients' optimizer.
    robust: "none" (the sample-weighted mean) or a robust rule of `ROBUST`:
      "median", "trimmed_mean" (coordinate-wise), "krum", "multi_krum",
      "bulyan", "geometric_median", "centered_clipping";
      docs/methods.md#robust-options, docs/robustness.md.
    trim_fraction: the trimmed mean's fraction cut at each end, in [0, 0.5).
    max_share: a bound on any client's share of the weights, in (0, 1]
      (`pflax.aggregate.capped_weights`; with robust "none" only).
    clip_norm: each update `w_i - w` clipped to this norm before aggregating
      (`pflax.aggregate.clip_updates`).
    num_byzantine: f, the Byzantine clients Krum, Multi-Krum (which averages
      the n - f best) and Bulyan tolerate.
    radius: centered clipping's tau.

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
      global_aggregator(robust, trim_fraction, max_share, num_byzantine, radius),
      clip_norm=clip_norm, uploads=alg.everything if robust == "none" else None)


METHOD = methods.Method(
    name="fedavg", builder=fedavg,
    paper=('McMahan et al., "Communication-Efficient Learning of Deep Networks '
           'from Decentralized Data", AISTATS 2017'),
    shares_head=True, default=True,
    differentiable=("lr",))
