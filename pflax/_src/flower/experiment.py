"""What a federation runs, as the server and every node build it."""

import dataclasses
import importlib
import json
import os
import sys
from typing import Any

from pflax._src.simulation import experiment as simulation_experiment
from pflax._src.simulation import groups as groups_lib
from pflax._src.training import adapters
from pflax._src.training import parts as parts_lib

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


def _imported(name: str, field: str) -> Any:
  """The object a `"module:attr"` import string names (`BUILDER_PATH` appended
  to `sys.path` first)."""
  module, _, attr = name.partition(":")
  if not (module and attr):
    raise ValueError(f"{field} given as a string must be 'module:attr', got {name!r}.")
  try:
    return getattr(importlib.import_module(module), attr)
  except (ImportError, AttributeError) as e:
    raise ValueError(f"cannot import the {field} {name!r}: {e}") from None


def _sent(value: Any) -> Any:
  """What travels of a model or parts: an import string or None as it is, an
  object as `{"given": its name}` (each node is given the object itself)."""
  if value is None or isinstance(value, str):
    return value
  return {"given": adapters.model_name(value)}


def _received(field: str, sent: Any, given: Any) -> Any:
  """A node's model or parts: `given` (to `client_app`) where the server's was
  given in code, else the import string or None that travelled.

  Raises:
    ValueError: when the node and the server disagree on whether it was given.
  """
  if isinstance(sent, dict):
    if given is None:
      raise ValueError(f"the experiment runs a {field} given in code "
                       f"({sent['given']}), which cannot travel: give the same one "
                       f"to this node's client_app({field}=...).")
    return given
  if given is not None:
    raise ValueError(f"client_app was given a {field}, but the server's experiment "
                     f"has none given in code ({field}={sent!r}): give the server's "
                     f"Experiment the same {field}.")
  return sent


@dataclasses.dataclass(frozen=True)
class Experiment:
  """What a federation runs: an algorithm (a name of `pflax.algorithms.METHODS`
  or `"module:builder"`), its `ExperimentConfig` and the seed.

  `model` (None: `config.model`) is any model `pflax.simulate.run` takes, and
  `parts` its `pflax.models.Parts` (None: found from the model). Each is either
  a `"module:attr"` import string, which travels to the nodes and is imported
  by every process (a deployed federation), or the object itself, which
  cannot travel: the server's `Experiment` and every node's
  `client_app(model=..., parts=...)` are given the same one (`run_in_process`
  does both).
  """
  algorithm: str
  config: simulation_experiment.ExperimentConfig
  seed: int = 0
  model: Any = None
  parts: Any = None

  def to_json(self) -> str:
    return json.dumps({"algorithm": self.algorithm, "seed": self.seed,
                       "config": dataclasses.asdict(self.config),
                       "model": _sent(self.model), "parts": _sent(self.parts)},
                      sort_keys=True)

  @classmethod
  def from_json(cls, text: str, model: Any = None, parts: Any = None
                ) -> "Experiment":
    """The experiment `to_json` wrote; `model` and `parts` are a node's own
    (`client_app`), required where the server's were given in code.

    Raises:
      ValueError: when they are given and the server's were not, or the reverse.
    """
    d = json.loads(text)
    return cls(d["algorithm"], simulation_experiment.ExperimentConfig(**d["config"]),
               int(d["seed"]),
               _received("model", d.get("model"), model),
               _received("parts", d.get("parts"), parts))

  def check(self) -> None:
    """Raises ValueError for what a federation does not run."""
    _append_builder_path()
    simulation_experiment.check_algorithm(self.algorithm, self.config)
    simulation_experiment.check_heterogeneous(self.algorithm, self.config)
    if self.config.faulty_clients:
      raise ValueError("faulty_clients is a simulation of faults: 0 in a federation, "
                       f"got {self.config.faulty_clients}.")
    if self.config.dp_clip is not None:
      raise ValueError("dp_clip: client-level DP runs in simulations only; a Flower "
                       "server samples a fixed number of clients a round, not Poisson "
                       "at rate q as the accountant assumes (docs/privacy.md).")

  def check_travels(self) -> None:
    """Raises ValueError where the model or parts are objects, which a deployed
    federation's processes cannot receive."""
    for field, value in (("model", self.model), ("parts", self.parts)):
      if not (value is None or isinstance(value, str)):
        raise ValueError(
            f"the experiment's {field} is a Python object ({_sent(value)['given']}), "
            "which cannot travel to a deployed federation's processes: give it as "
            f"an import string, Experiment({field}='module:attr'), its module in a "
            f"directory of {BUILDER_PATH} or installed.")

  def build(self, input_shape: tuple[int, ...], num_classes: int
            ) -> tuple[groups_lib.Groups, parts_lib.Parts]:
    """The algorithm over the federation's clients as `pflax.simulate` builds it
    (with `config.heterogeneous`, one group per architecture), for inputs of
    `input_shape` in `num_classes` classes, and the model's parts."""
    _append_builder_path()
    model, parts = (_imported(v, f) if isinstance(v, str) else v
                    for v, f in ((self.model, "model"), (self.parts, "parts")))
    algorithm, model, parts = simulation_experiment.build_algorithm(
        self.algorithm, self.config, input_shape, num_classes, model=model,
        parts=parts)
    return groups_lib.as_groups(algorithm, model, self.config.clients), parts
