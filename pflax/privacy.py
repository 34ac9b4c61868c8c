"""Client-level differential privacy (DP-FedAvg) and its accountant."""

from pflax._src.aggregators.accounting import epsilon
from pflax._src.aggregators.accounting import epsilons
from pflax._src.aggregators.accounting import noise_multiplier_for
from pflax._src.aggregators.accounting import rounds_within
from pflax._src.aggregators.privacy import clip_deltas
from pflax._src.aggregators.privacy import dp_class_models
from pflax._src.aggregators.privacy import dp_mean
from pflax._src.aggregators.privacy import noisy_sum
from pflax._src.aggregators.privacy import poisson_sample
from pflax._src.aggregators.privacy import update_norms
from pflax._src.methods.privacy import REFUSED
from pflax._src.methods.privacy import not_covered
from pflax._src.methods.privacy import private

__all__ = (
    "REFUSED",
    "clip_deltas",
    "dp_class_models",
    "dp_mean",
    "epsilon",
    "epsilons",
    "noise_multiplier_for",
    "noisy_sum",
    "not_covered",
    "poisson_sample",
    "private",
    "rounds_within",
    "update_norms",
)
