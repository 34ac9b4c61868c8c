"""FedClassAvg (Jang et al., ICPP 2022): averaged classifier, SupCon, proximal head."""

from typing import NamedTuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from pflax._src import methods
from pflax._src.aggregators import privacy as privacy_lib
from pflax._src.core import tree as tree_lib
from pflax._src.core import types
from pflax._src.core import weights as weights_lib
from pflax._src.data import augment as augment_lib
from pflax._src.methods import algorithm as alg
from pflax._src.methods import common
from pflax._src.methods import fedavg
from pflax._src.training import losses
from pflax._src.training import parts as parts_lib


class SharedHead(NamedTuple):
  """FedClassAvg's state: each client's own model and the averaged classifier.

  Attributes:
    params: `(M, ...)` each client's locally trained model (own classifier).
    head: the sample-weighted mean of the clients' classifiers (Eq. 3), a tree
      of the classifier's leaves only (`pflax.tree.selected`).
    num_samples: `(M,)` training-set sizes.
  """
  params: types.Stacked
  head: types.Tree
  num_samples: chex.Array


def fedclassavg(model: nn.Module, optimizer: optax.GradientTransformation, *,
                rho: float = 0.1, supcon: bool = True,
                supcon_temperature: float = 100.0,
                supcon_base_temperature: float = 0.07,
                warmup_epochs: int = 1,
                classifier: types.Selector | None = None,
                parts: parts_lib.Parts | None = None,
                augment: str = "translate", robust: str = "none",
                trim_fraction: float = 0.1, num_byzantine: int = 0,
                radius: float = 1.0) -> alg.Algorithm:
  """FedClassAvg (Jang et al.): averaged classifier, SupCon on two views, proximal head.

  Local objective (Eq. 4): `CE(y, f(x')) + SupCon(F(x'), F(x'')) +
  rho/2 sum_tensors mean((C_k - C)^2)`, with C the averaged classifier and x',
  x'' two random views of the batch (`augment`). A client's personalized model is
  its own feature extractor with its own classifier (Algorithm 1's output);
  `global` is the averaged classifier on the client's own features.

  Args:
    model: the clients' Flax model.
    optimizer: the clients' optimizer (the paper: Adam, betas (0.5, 0.999)).
    rho: weight of the proximal term (>= 0; 0 switches it off).
    supcon: whether to add the SupCon term (False: CE on one view plus the
      proximal term, the second view is not drawn; the paper's Table 4
      ablation).
    supcon_temperature, supcon_base_temperature: the SupCon loss's (> 0).
    warmup_epochs: local epochs of every client before round 1 (0: none).
    classifier: selector of the averaged classifier (None: the output layer).
    parts: the model's `pflax.models.Parts` (its output layer and
      representation); None for pflax's models.
    augment: how the views x', x'' are drawn (Eq. 4 leaves it open):
      `"translate"` (two random edge-padded translations, the default),
      `"simclr"` (the authors' code: RandomResizedCrop scale (0.2, 1), flip,
      brightness/contrast/saturation jitter 0.4 with p = 0.8, no hue jitter;
      `pflax._src.data.augment.simclr`) or `"none"` (the batch itself; only
      with `supcon=False`, since SupCon's two views would be equal).
    robust, trim_fraction, num_byzantine, radius: the rule that aggregates
      the classifiers, as FedAvg's (`pflax.algorithms.fedavg`; "none": the
      sample-weighted mean; docs/robustness.md).

  Notes:
    [settled: authors' code] SupCon acts on the last hidden layer's linear
    output before the classifier's ReLU (pflax models' `representation`, the
    authors' `fcin`); on another model, on `parts.representation`, by default
    the output layer's input. The proximal term is a mean per tensor.
  """
  alg.check_range("rho", rho, 0.0)
  alg.check_range("supcon_temperature", supcon_temperature, 0.0, open_low=True)
  alg.check_range("supcon_base_temperature", supcon_base_temperature, 0.0,
                  open_low=True)
  if warmup_epochs < 0:
    raise ValueError(f"warmup_epochs must be >= 0, got {warmup_epochs}.")
  view = augment_lib.view_fn(augment, "fedclassavg's augment")
  if augment == "none" and supcon:
    raise ValueError("fedclassavg's augment='none' needs supcon=False: "
                     "SupCon's two views would both be the batch itself.")
  parts = parts_lib.resolve(model, parts, "fedclassavg")
  classifier = parts.output if classifier is None else classifier
  representation = parts_lib.representation_fn(model, parts)
  aggregate = fedavg.global_aggregator(robust, trim_fraction, None, num_byzantine,
                                       radius)

  def loss(params, global_head, batch, key):
    k1, k2 = jax.random.split(key)
    view1 = view(k1, batch.x)
    own_head = tree_lib.selected(params, classifier)
    prox = losses.proximal(own_head, global_head, reduce="mean")
    total = (losses.cross_entropy(alg.logits(model, params, view1), batch.y, batch.mask)
             + rho * prox)
    if not supcon:
      return total
    view2 = view(k2, batch.x)
    feats = jnp.concatenate([representation(params, view1),
                             representation(params, view2)])
    labels = jnp.concatenate([batch.y, batch.y])
    valid = jnp.concatenate([batch.mask, batch.mask])
    return total + losses.supcon(feats, labels, supcon_temperature,
                                 supcon_base_temperature, mask=valid)

  def global_heads(state):
    return tree_lib.broadcast(state.head, state.num_samples.shape[0])

  def client_models(state):
    return tree_lib.with_selected(state.params, classifier, global_heads(state))

  def server_update(state, trained, mask, key):
    del key
    heads = tree_lib.selected(trained, classifier)
    return state._replace(
        params=weights_lib.keep_masked(trained, state.params, mask),
        head=aggregate(heads, state.num_samples, mask=mask, reference=state.head))

  def init(params, class_counts, key):
    del key
    return SharedHead(params, tree_lib.selected(common.first(params), classifier),
                      common.sample_counts(class_counts))

  def private_update(clip_norm, noise_multiplier, expected_participants):
    """Eq. 3 under client-level DP: the classifier moves by DP-FedAvg's noised
    mean of the participants' classifier updates (uniform weights in place of
    the private `|D_k|`; each client started this round from the global
    classifier, Algorithm 1 line 5); each participant keeps its own trained
    model, which never leaves it (docs/privacy.md#fedclassavg)."""
    def server_update(state, trained, mask, key):
      updates = jax.tree.map(lambda h, c: h - c, tree_lib.selected(trained, classifier),
                             state.head)
      mean = privacy_lib.dp_mean(updates, key, clip_norm, noise_multiplier,
                                 expected_participants, mask=mask)
      return state._replace(
          params=weights_lib.keep_masked(trained, state.params, mask),
          head=jax.tree.map(lambda c, d: (c + d).astype(c.dtype), state.head, mean))
    return server_update

  # The warm-up only keeps each client's own trained model: nothing is sent.
  warmup = (alg.Warmup(warmup_epochs, lambda state, trained, mask:
                       state._replace(params=trained), local=True)
            if warmup_epochs else None)
  return alg.Algorithm(
      init=init, client_models=client_models, loss=loss, optimizer=optimizer,
      server_update=server_update,
      evaluate=lambda state: {"personalized": state.params,
                              "global": client_models(state)},
      client_context=global_heads,
      warmup=warmup,
      private_update=private_update if robust == "none" else None,
      # Unrolled, the two-view SupCon step compiled in 158 s instead of 13 s
      # and ran 7x slower (MLP on digits, 7 steps): keep the loop rolled.
      unroll=1)


METHOD = methods.Method(
    name="fedclassavg", builder=fedclassavg,
    paper=('Jang et al., "FedClassAvg: Local Representation Learning for '
           'Personalized Federated Learning on Heterogeneous Neural '
           'Networks", ICPP 2022'),
    optimizer={"optimizer": "adam", "lr": 1e-3, "adam_b1": 0.5},
    shares_head=True, default=True,
    differentiable=("lr", "rho"),
    not_differentiable={
        "supcon_temperature": "smooth, but its hypergradient is not tested yet",
        "supcon_base_temperature": "smooth, but its hypergradient is not tested yet"},
    test=methods.TestSpec(kwargs={"rho": 0.8, "supcon_temperature": 2.0,
                                 "supcon_base_temperature": 0.5}))
