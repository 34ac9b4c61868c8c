"""Federated simulation: prepare a federation, run rounds, evaluate."""

from pflax._src.simulate import ExperimentConfig
from pflax._src.simulate import Setup
from pflax._src.simulate import output_norms
from pflax._src.simulate import participants
from pflax._src.simulate import prepare
from pflax._src.simulate import run

__all__ = (
    "ExperimentConfig",
    "Setup",
    "output_norms",
    "participants",
    "prepare",
    "run",
)
