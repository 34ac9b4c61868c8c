"""Differentiable rounds: hypergradients of the clients' validation loss with respect
to an algorithm's float hyperparameters, and a gradient-based tuner."""

from pflax._src.tune import DIFFERENTIABLE
from pflax._src.tune import FRACTIONS
from pflax._src.tune import NOT_DIFFERENTIABLE
from pflax._src.tune import Outcome
from pflax._src.tune import PARAMETRIZATIONS
from pflax._src.tune import Task
from pflax._src.tune import TuneRecord
from pflax._src.tune import TuneStep
from pflax._src.tune import Validation
from pflax._src.tune import check_keys
from pflax._src.tune import differentiable_keywords
from pflax._src.tune import from_unconstrained
from pflax._src.tune import hold_out
from pflax._src.tune import initial_carry
from pflax._src.tune import make_task
from pflax._src.tune import parametrization
from pflax._src.tune import plot_tuning
from pflax._src.tune import to_unconstrained
from pflax._src.tune import tune
from pflax._src.tune import validation_loss

__all__ = (
    "DIFFERENTIABLE",
    "FRACTIONS",
    "NOT_DIFFERENTIABLE",
    "Outcome",
    "PARAMETRIZATIONS",
    "Task",
    "TuneRecord",
    "TuneStep",
    "Validation",
    "check_keys",
    "differentiable_keywords",
    "from_unconstrained",
    "hold_out",
    "initial_carry",
    "make_task",
    "parametrization",
    "plot_tuning",
    "to_unconstrained",
    "tune",
    "validation_loss",
)
