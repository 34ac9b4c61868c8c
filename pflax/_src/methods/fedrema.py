"""FedReMa (Liang et al., ECAI 2024): relevance-matched classifiers."""

from typing import NamedTuple

import chex
import flax.linen as nn
import optax

from pflax._src import methods
from pflax._src.aggregators import fedrema as rema_lib
from pflax._src.core import tree as tree_lib
from pflax._src.core import types
from pflax._src.methods import algorithm as alg
from pflax._src.methods import common
from pflax._src.training import parts as parts_lib


class MatchedClassifiers(NamedTuple):
  """FedReMa's state: each client's model, sample counts, the history map."""
  params: types.Stacked
  num_samples: chex.Array
  history: rema_lib.FedReMaState


def fedrema(model: nn.Module, optimizer: optax.GradientTransformation,
            *, delta: float = 0.5, temperature: float = 0.5,
            parts: parts_lib.Parts | None = None) -> alg.Algorithm:
  """FedReMa (Liang et al.): FedAvg feature extractor, relevance-matched classifiers.

  The classifier is every Dense layer after the feature extractor; soft logits
  (temperature `temperature`) come from one uniform random probe per round;
  each client's classifier is the mean of its most relevant peers' (maximum
  difference segmentation) during the critical co-learning period, then by the
  history map (Eqs. 3-9). The clients' optimizer state is kept across rounds
  (the paper's SGD with momentum).

  Args:
    model: the clients' Flax model.
    optimizer: the clients' optimizer.
    delta: the CCP threshold on the maximum gap, in [0, 1].
    temperature: the soft-logit temperature (> 0).
    parts: the model's `pflax.models.Parts` (its classifier); None for pflax's
      models, whose classifier is every Dense layer after the features.
  """
  alg.check_range("delta", delta, 0.0, 1.0)
  alg.check_range("temperature", temperature, 0.0, open_low=True)
  parts = parts_lib.resolve(model, parts, "fedrema")
  where = parts_lib.classifier_selector(parts)
  apply_classifier = parts_lib.classifier_fn(parts)

  def server_update(state, trained, mask, key):
    classifiers = tree_lib.selected(trained, where)
    logits = rema_lib.probe_logits(apply_classifier, classifiers, key,
                                   parts_lib.classifier_width(parts, classifiers))
    soft = rema_lib.soft_logits(logits, temperature)
    params, history = rema_lib.fedrema(trained, state.num_samples, soft, state.history,
                                       where=where, delta=delta, mask=mask)
    return state._replace(params=params, history=history)

  return alg.Algorithm(
      init=lambda params, class_counts, key: MatchedClassifiers(
          params, common.sample_counts(class_counts),
          rema_lib.fedrema_init(class_counts.shape[0])),
      client_models=lambda state: state.params,
      loss=alg.cross_entropy_loss(model), optimizer=optimizer,
      server_update=server_update,
      evaluate=lambda state: {"personalized": state.params},
      keep_opt_state=True)


METHOD = methods.Method(
    name="fedrema", builder=fedrema,
    paper=('Liang et al., "FedReMa: Improving Personalized Federated Learning via '
           'Leveraging the Most Relevant Clients", ECAI 2024'),
    shares_head=False, default=True,
    differentiable=("lr",),
    not_differentiable={
        "temperature": "the soft logits enter only the MDS selection of peers and "
                       "the CCP test (booleans), so its gradient is exactly 0",
        "delta": "a threshold of the CCP test (a boolean)"},
    test=methods.TestSpec(kwargs={"temperature": 0.7}))
