"""What a federation runs, as the server and every node build it."""

import dataclasses
import json
import os
import sys

from pflax._src.simulation import groups as groups_lib
from pflax._src.simulation import simulate

BUILDER_PATH = "PFLAX_BUILDER_PATH"
"""An environment variable of a federation's processes: directories
(`os.pathsep`-separated) appended to the end of `sys.path`, after the installed
packages, before an `Experiment` imports its `module:builder` (`pflax-run
--flower` puts the current folder there, never on `PYTHONPATH`, which would come
before the installed packages: a `sitecustomize.py` in it would run in every
process of the federation)."""


def _append_builder_path() -> None:
  for directory in os.environ.get(BUILDER_PATH, "").split(os.pathsep):
    if directory and directory not in sys.path:
      sys.path.append(directory)


@dataclasses.dataclass(frozen=True)
class Experiment:
  """What a federation runs: an algorithm (a name of `pflax.algorithms.BUILDERS`
  or `"module:builder"`), its `ExperimentConfig` and the seed."""
  algorithm: str
  config: simulate.ExperimentConfig
  seed: int = 0

  def to_json(self) -> str:
    return json.dumps({"algorithm": self.algorithm, "seed": self.seed,
                       "config": dataclasses.asdict(self.config)}, sort_keys=True)

  @classmethod
  def from_json(cls, text: str) -> "Experiment":
    d = json.loads(text)
    return cls(d["algorithm"], simulate.ExperimentConfig(**d["config"]), int(d["seed"]))

  def check(self) -> None:
    """Raises ValueError for what a federation does not run."""
    _append_builder_path()
    simulate.check_config(self.config)
    simulate.check_algorithm(self.algorithm, self.config)
    simulate.check_heterogeneous(self.algorithm, self.config)
    if self.config.faulty_clients:
      raise ValueError("faulty_clients is a simulation of faults: 0 in a federation, "
                       f"got {self.config.faulty_clients}.")

  def groups(self, input_shape: tuple[int, ...], num_classes: int) -> groups_lib.Groups:
    """The algorithm over the federation's clients as `pflax.simulate` builds it
    (with `config.heterogeneous`, one group per architecture), for inputs of
    `input_shape` in `num_classes` classes."""
    _append_builder_path()
    algorithm, model = simulate.build_algorithm(self.algorithm, self.config,
                                                input_shape, num_classes)
    return groups_lib.as_groups(algorithm, model, self.config.clients)
