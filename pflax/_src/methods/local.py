"""Local training: each client keeps its own model, no aggregation."""

from collections.abc import Callable
from typing import NamedTuple

import flax.linen as nn
import jax
import optax

from pflax._src import methods
from pflax._src.core import types
from pflax._src.core import weights as weights_lib
from pflax._src.data import augment as augment_lib
from pflax._src.methods import algorithm as alg
from pflax._src.training import losses


class ClientModels(NamedTuple):
  """Each client's own model (`local`)."""
  params: types.Stacked


def _augmented_cross_entropy(model: nn.Module, view: Callable) -> Callable:
  """CE on one view `view(k1, x)` of the batch, `k1 = split(key)[0]`: the view
  FedClassAvg's CE term sees for the same step key."""
  def loss(params, context, batch, key):
    del context
    x = view(jax.random.split(key)[0], batch.x)
    return losses.cross_entropy(alg.logits(model, params, x), batch.y, batch.mask)
  return loss


def local(model: nn.Module, optimizer: optax.GradientTransformation, *,
          augment: str = "none") -> alg.Algorithm:
  """Local training only: each client keeps its own model, no aggregation.

  Args:
    model: the clients' Flax model.
    optimizer: the clients' optimizer.
    augment: the view each batch is trained on: `"none"` (the images as they are,
      the default), `"translate"` (a random translation) or `"simclr"` (one of
      the SimCLR views FedClassAvg's authors train FedClassAvg on,
      `pflax._src.data.augment.simclr`). FedClassAvg (Jang et al., ICPP 2022)
      compares against a Local baseline trained without augmentation;
      `augment="simclr"` is the baseline with FedClassAvg's views.
  """
  view = augment_lib.view_fn(augment, "local's augment")
  loss = (alg.cross_entropy_loss(model) if augment == "none"
          else _augmented_cross_entropy(model, view))

  def server_update(state, trained, mask, key):
    del key
    return ClientModels(weights_lib.keep_masked(trained, state.params, mask))

  return alg.Algorithm(
      init=lambda params, class_counts, key: ClientModels(params),
      client_models=lambda state: state.params,
      loss=loss, optimizer=optimizer,
      server_update=server_update,
      evaluate=lambda state: {"personalized": state.params})


METHOD = methods.Method(
    name="local", builder=local,
    paper="the Local baseline of personalized-FL papers (no aggregation)",
    shares_head=True, default=True,
    differentiable=("lr",))
