"""Federated simulation: configure an experiment, run it, sweep it, read, tabulate and
plot its records; the round every run takes (`round_step`); settings that differ
only in their partition (`PARTITION_FIELDS`) side by side (`sweep_settings`)."""

from pflax._src.simulation.engine import round_step
from pflax._src.simulation.experiment import PARTITION_FIELDS
from pflax._src.simulation.experiment import ExperimentConfig
from pflax._src.simulation.experiment import Setup
from pflax._src.simulation.experiment import client_optimizer
from pflax._src.simulation.experiment import prepare
from pflax._src.simulation.experiment import resolve_builder
from pflax._src.simulation.experiment import sweepable
from pflax._src.simulation.plots import algorithm_color
from pflax._src.simulation.plots import plot_accuracy
from pflax._src.simulation.plots import plot_output_norms
from pflax._src.simulation.plots import save_plots
from pflax._src.simulation.records import Accuracy
from pflax._src.simulation.records import Results
from pflax._src.simulation.records import RoundRecord
from pflax._src.simulation.records import RunRecord
from pflax._src.simulation.records import Summary
from pflax._src.simulation.simulate import run
from pflax._src.simulation.simulate import sweep
from pflax._src.simulation.simulate import sweep_settings

__all__ = (
    "Accuracy",
    "ExperimentConfig",
    "PARTITION_FIELDS",
    "Results",
    "RoundRecord",
    "RunRecord",
    "Setup",
    "Summary",
    "algorithm_color",
    "client_optimizer",
    "plot_accuracy",
    "plot_output_norms",
    "prepare",
    "resolve_builder",
    "round_step",
    "run",
    "save_plots",
    "sweep",
    "sweep_settings",
    "sweepable",
)
