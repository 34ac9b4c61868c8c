"""Federated simulation: prepare a federation, run rounds, evaluate, sweep."""

from pflax._src.simulate import ExperimentConfig
from pflax._src.simulate import Setup
from pflax._src.simulate import output_norms
from pflax._src.simulate import participants
from pflax._src.simulate import prepare
from pflax._src.simulate import run
from pflax._src.sweep import SWEEPABLE
from pflax._src.sweep import client_shardings
from pflax._src.sweep import pad_clients
from pflax._src.sweep import stack_federations
from pflax._src.sweep import sweep

__all__ = (
    "ExperimentConfig",
    "Setup",
    "client_shardings",
    "output_norms",
    "pad_clients",
    "participants",
    "prepare",
    "run",
    "stack_federations",
    "sweep",
    "SWEEPABLE",
)
