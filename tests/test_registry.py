"""`pflax.algorithms.METHODS`, the one list of pflax's methods, and its derived tables."""

import dataclasses
import importlib
import pkgutil

import pytest

from pflax import algorithms
from pflax import simulate
from pflax._src import methods as methods_pkg
from pflax._src.cli import parser as cli_parser
from pflax._src.methods import registry
from pflax._src.simulation import experiment as experiment_lib

# Modules of pflax._src.methods that are not a method.
HELPERS = ("algorithm", "common", "heterogeneous", "phases", "privacy", "registry")


def test_every_method_file_is_registered_under_its_own_name():
  files = {info.name for info in pkgutil.iter_modules(methods_pkg.__path__)
           if info.name not in HELPERS}
  assert files == set(algorithms.METHODS)
  for name in files:
    method = importlib.import_module(f"pflax._src.methods.{name}").METHOD
    assert algorithms.METHODS[name] is method and method.name == name


def test_tables_are_derived_from_the_registry():
  assert list(algorithms.METHODS) == list(registry.NAMES)
  assert all(getattr(algorithms, name) is method.builder
             for name, method in algorithms.METHODS.items())
  assert registry.METHODS is algorithms.METHODS
  assert registry.DEFAULT_ALGORITHMS == ("local", "fedavg", "fedprox", "cwfedavg",
                                         "fedclassavg", "fedsa", "feddwa", "fedrema")
  assert experiment_lib.HEAD_SHARING == ("local", "fedavg", "cwfedavg", "fedclassavg",
                                       "fedsa")
  assert all(name in cli_parser.FIELD_HELP["heterogeneous"]
             for name in experiment_lib.HEAD_SHARING)


def test_config_optimizers_default_to_the_methods_own_as_fresh_dicts():
  first, second = simulate.ExperimentConfig(), simulate.ExperimentConfig()
  assert first.optimizers == {"fedclassavg": {"optimizer": "adam", "lr": 1e-3,
                                              "adam_b1": 0.5}}
  first.optimizers["fedclassavg"]["lr"] = 1.0
  assert second.optimizers["fedclassavg"]["lr"] == 1e-3
  assert algorithms.METHODS["fedclassavg"].optimizer["lr"] == 1e-3


def test_method_is_frozen_and_keyword_only():
  method = algorithms.METHODS["fedavg"]
  with pytest.raises(dataclasses.FrozenInstanceError):
    method.default = False
  with pytest.raises(TypeError):
    algorithms.Method("x", method.builder, "a paper", False, None, False)
