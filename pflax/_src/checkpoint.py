"""Checkpoints of a sweep that cannot execute code when loaded (no pickle).

A checkpoint is one msgpack file (`flax.serialization`): the round reached,
the seconds spent, the runs' histories as JSON and the state of every run as
arrays, restored into the structure of a freshly initialised state. Writes are
atomic (a temporary file renamed over the old one).
"""

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import serialization

from pflax._src import records


def file_name(algorithm: str, runs: Sequence[tuple[float | None, int]]) -> str:
  """The checkpoint file of an algorithm's sweep over `(value, seed)` runs."""
  seeds = sorted({s for _, s in runs})
  values = sorted({v for v, _ in runs if v is not None})
  tag = "-".join(f"seed{s}" for s in seeds)
  if values:
    tag += "-values" + "_".join(f"{v:g}" for v in values)
  return f"{algorithm.replace(':', '.')}-{tag}.ckpt"


def _corrupt(path: str, error: Exception) -> ValueError:
  return ValueError(f"checkpoint {path} is corrupt or not a pflax checkpoint: {error}")


class Checkpointer:
  """Saves a sweep every `every` rounds to `path`; restores it when resuming.

  Args:
    path: the checkpoint file.
    every: save after every this many rounds (0: never).
    resume: whether `restore` reads an existing checkpoint.
    template: `template() -> carry`, a state of the sweep's structure (shapes
      and dtypes suffice) to restore into.
    experiment: what defines the sweep (its configuration, algorithm, seeds
      and values) as JSON-able values: stored with the checkpoint, and a
      checkpoint of another experiment is refused on resume.
  """

  def __init__(self, path: str, every: int, resume: bool,
               template: Callable[[], Any], experiment: dict[str, Any]):
    if every < 0:
      raise ValueError(f"checkpoint_every must be >= 0, got {every}.")
    self.path, self.every, self.resume, self.template = path, every, resume, template
    self.experiment = json.loads(json.dumps(experiment, default=repr))

  def due(self, rounds_done: int) -> bool:
    return bool(self.every) and rounds_done % self.every == 0

  def save(self, carry: Any, rounds_done: int,
           histories: Sequence[Sequence[records.RoundRecord]], seconds: float) -> None:
    payload = {"round": rounds_done, "seconds": seconds,
               "experiment": json.dumps(self.experiment),
               "history": json.dumps([[h.to_json() for h in hist] for hist in histories]),
               "carry": serialization.to_state_dict(jax.tree.map(np.asarray, carry))}
    os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
    tmp = self.path + ".tmp"
    with open(tmp, "wb") as f:
      f.write(serialization.msgpack_serialize(payload))
    os.replace(tmp, self.path)

  def restore(self) -> tuple[Any, int, list[list[records.RoundRecord]], float] | None:
    """`(carry, rounds_done, histories, seconds)`, or None without a checkpoint."""
    if not (self.resume and os.path.exists(self.path)):
      return None
    try:
      with open(self.path, "rb") as f:
        payload = serialization.msgpack_restore(f.read())
      saved = json.loads(payload["experiment"])
    except Exception as e:  # pylint: disable=broad-except
      raise _corrupt(self.path, e) from None
    differ = sorted(k for k in set(saved) | set(self.experiment)
                    if saved.get(k) != self.experiment.get(k))
    if differ:
      raise ValueError(f"checkpoint {self.path} is of another experiment: "
                       f"{', '.join(differ)} differ; resume with the same "
                       "configuration or remove the checkpoint.")
    try:
      carry = serialization.from_state_dict(self.template(), payload["carry"])
      histories = [[records.RoundRecord.from_json(h) for h in hist]
                   for hist in json.loads(payload["history"])]
      return carry, int(payload["round"]), histories, float(payload["seconds"])
    except Exception as e:  # pylint: disable=broad-except
      raise _corrupt(self.path, e) from None
