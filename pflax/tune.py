"""Differentiable rounds: hypergradients of the clients' validation loss with respect
to an algorithm's float hyperparameters, and a gradient-based tuner."""

from pflax._src.simulation.tune import DIFFERENTIABLE
from pflax._src.simulation.tune import FRACTIONS
from pflax._src.simulation.tune import NOT_DIFFERENTIABLE
from pflax._src.simulation.tune import Outcome
from pflax._src.simulation.tune import PARAMETRIZATIONS
from pflax._src.simulation.tune import Task
from pflax._src.simulation.tune import TuneRecord
from pflax._src.simulation.tune import TuneStep
from pflax._src.simulation.tune import Validation
from pflax._src.simulation.tune import check_keys
from pflax._src.simulation.tune import differentiable_keywords
from pflax._src.simulation.tune import from_unconstrained
from pflax._src.simulation.tune import hold_out
from pflax._src.simulation.tune import initial_carry
from pflax._src.simulation.tune import make_task
from pflax._src.simulation.tune import parametrization
from pflax._src.simulation.tune import plot_tuning
from pflax._src.simulation.tune import to_unconstrained
from pflax._src.simulation.tune import tune
from pflax._src.simulation.tune import validation_loss

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
