"""Federated simulation: configure an experiment, run it, sweep it, read, tabulate and
plot its records."""

from pflax._src.engine import output_norms
from pflax._src.engine import participants
from pflax._src.plots import algorithm_color
from pflax._src.plots import plot_accuracy
from pflax._src.plots import plot_output_norms
from pflax._src.records import Accuracy
from pflax._src.records import Results
from pflax._src.records import RoundRecord
from pflax._src.records import RunRecord
from pflax._src.records import Summary
from pflax._src.sharding import client_shardings
from pflax._src.simulate import ExperimentConfig
from pflax._src.simulate import Setup
from pflax._src.simulate import client_optimizer
from pflax._src.simulate import prepare
from pflax._src.simulate import resolve_builder
from pflax._src.simulate import run
from pflax._src.simulate import sweep
from pflax._src.simulate import sweepable

__all__ = (
    "Accuracy",
    "ExperimentConfig",
    "Results",
    "RoundRecord",
    "RunRecord",
    "Setup",
    "Summary",
    "algorithm_color",
    "client_optimizer",
    "client_shardings",
    "output_norms",
    "participants",
    "plot_accuracy",
    "plot_output_norms",
    "prepare",
    "resolve_builder",
    "run",
    "sweep",
    "sweepable",
)
