"""Checkpoints of a sweep that cannot execute code when loaded (no pickle).

A checkpoint is one msgpack file (`flax.serialization`): the round reached,
the seconds spent, the runs' histories as JSON and the state of every run as
arrays (the engine's `Carry`, stored as the pair `(state, opt_states)`, keys
"0" and "1"), restored into the structure of a freshly initialised state.
Writes are atomic and follow no symlink (`records.write_file`). A restored
checkpoint is checked against the experiment before any round runs
(`check_restored`).
"""

import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import serialization

from pflax._src.simulation import engine
from pflax._src.simulation import records


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


MAX_STATE = 1e10
"""The largest magnitude of a float in a restored state: a trained model's
weights and optimizer moments are far below; 1e30 is a forged checkpoint."""
COUNT_FIELDS = ("num_samples", "class_counts")
"""State fields holding the clients' data counts, fixed by the experiment: a
restored checkpoint must hold the experiment's own (`Checkpointer.counts`)."""


def _record_problem(record: records.RoundRecord, clients: int) -> str | None:
  """What is implausible in one round's record: a loss that is not a finite
  number, an accuracy or per-client statistic outside [0, 1], a client index
  outside [0, clients)."""
  number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
  if not number(record.train_loss) or not math.isfinite(record.train_loss):
    return f"its train_loss {record.train_loss!r} is not a finite number"
  for kind, acc in record.accuracies.items():
    for field in ("accuracy", "client_mean", "client_std"):
      value = getattr(acc, field)
      nan_allowed = field != "accuracy"   # files older than the statistics
      if not number(value) or not (0 <= value <= 1 or (nan_allowed and value != value)):
        return f"its {kind} {field} {value!r} is not in [0, 1]"
  for field in ("dropped_clients", "faulty_clients"):
    ids = getattr(record, field)
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < clients
               for i in ids) or len(set(ids)) != len(ids):
      return f"its {field} {list(ids)!r} are not distinct clients in [0, {clients})"
  return None


def _history_problem(histories: Sequence[Sequence[records.RoundRecord]],
                     rounds_done: int, runs: int, clients: int) -> str | None:
  if len(histories) != runs:
    return f"the history is of {len(histories)} runs, the experiment has {runs}"
  for r, history in enumerate(histories):
    if len(history) != rounds_done:
      return (f"run {r}'s history has length {len(history)}, not the {rounds_done} "
              "rounds done")
    for t, record in enumerate(history, start=1):
      if record.round != t:
        return f"record {t} of run {r}'s history is of round {record.round!r}"
      problem = _record_problem(record, clients)
      if problem:
        return f"record {t} of run {r}'s history: {problem}"
  return None


def _counts_problem(name: str, leaf: np.ndarray, counts: Any) -> str | None:
  """Whether a count field of the state holds the experiment's counts."""
  if counts is None or not any(f".{field}" in name or f"'{field}'" in name
                               for field in COUNT_FIELDS):
    return None
  expected = next((np.asarray(c) for path, c in counts if path == name), None)
  if expected is not None and not np.array_equal(leaf, expected):
    return (f"state {name} is not the experiment's data counts (the clients' "
            "samples per class)")
  return None


def _state_problem(carry: engine.Carry, template: engine.Carry,
                   counts: Any = None) -> str | None:
  leaves = jax.tree.structure(template).flatten_up_to(carry)
  for (path, like), leaf in zip(jax.tree_util.tree_leaves_with_path(template), leaves):
    name, expected = jax.tree_util.keystr(path), (np.dtype(like.dtype), like.shape)
    try:
      leaf = np.asarray(leaf)
    except ValueError:
      return f"state {name} is not an array"
    if (leaf.dtype, leaf.shape) != expected:
      return (f"state {name} is {leaf.dtype}{leaf.shape}, the experiment's "
              f"{expected[0]}{expected[1]}")
    if np.issubdtype(leaf.dtype, np.inexact) and not np.isfinite(leaf).all():
      return f"state {name} is not finite"
    if np.issubdtype(leaf.dtype, np.inexact) and np.abs(leaf).max(initial=0) > MAX_STATE:
      return f"state {name} holds values beyond {MAX_STATE:g} in magnitude"
    problem = _counts_problem(name, leaf, counts)
    if problem:
      return problem
  return None


def state_counts(carry: engine.Carry) -> list[tuple[str, np.ndarray]]:
  """The count fields of a state (`COUNT_FIELDS`) by path, as a restored
  checkpoint must hold them."""
  return [(jax.tree_util.keystr(path), np.asarray(leaf))
          for path, leaf in jax.tree_util.tree_leaves_with_path(carry)
          if any(f".{field}" in jax.tree_util.keystr(path)
                 or f"'{field}'" in jax.tree_util.keystr(path)
                 for field in COUNT_FIELDS)]


def check_restored(path: str, carry: engine.Carry, rounds_done: Any,
                   histories: Sequence[Sequence[records.RoundRecord]], seconds: Any,
                   template: engine.Carry, rounds: int,
                   counts: Sequence[tuple[str, np.ndarray]] | None = None,
                   clients: int | None = None) -> None:
  """Raises ValueError, naming `path` and the first problem, unless a restored
  checkpoint fits its experiment.

  It fits if `rounds_done` is an integer in `[0, rounds]` (at `rounds` the
  sweep is complete), `seconds` a finite number >= 0, each run of `template`
  (its leading axis) has one record per round done (rounds `1..rounds_done`
  in order) with a finite loss, accuracies in [0, 1] and client indices in
  `[0, clients)`, and every leaf of `carry` has the shape and dtype of
  `template`'s, finite and at most `MAX_STATE` in magnitude if floating, its
  count fields (`COUNT_FIELDS`) equal to `counts` (`state_counts` of a fresh
  state) when given.
  """
  runs = jax.tree.leaves(template)[0].shape[0]
  if clients is None:
    clients = np.iinfo(np.int32).max
  if not isinstance(rounds_done, int) or isinstance(rounds_done, bool):
    problem = f"round {rounds_done!r} is not an integer"
  elif not 0 <= rounds_done <= rounds:
    problem = f"round {rounds_done} is outside [0, {rounds}]"
  elif (not isinstance(seconds, (int, float)) or isinstance(seconds, bool)
        or not math.isfinite(seconds) or seconds < 0):
    problem = f"seconds {seconds!r} is not a finite number >= 0"
  else:
    problem = (_history_problem(histories, rounds_done, runs, clients)
               or _state_problem(carry, template, counts))
  if problem:
    raise ValueError(f"checkpoint {path}: {problem}.")


Restored = tuple[engine.Carry, int, list[list[records.RoundRecord]], float]
"""A restored checkpoint: `(carry, rounds_done, histories, seconds)`."""


def _as_pair(carry: engine.Carry) -> tuple[Any, Any]:
  """The carry as the pair a checkpoint stores (flax would key the NamedTuple
  by its field names, a tuple by "0" and "1")."""
  return tuple(carry)


class Checkpointer:
  """Saves a sweep every `every` rounds to `path`; restores it when resuming.

  Args:
    path: the checkpoint file.
    every: save after every this many rounds (0: never).
    resume: whether `restore` reads an existing checkpoint.
    template: `template() -> Carry`, a state of the sweep's structure (shapes
      and dtypes suffice; every leaf with a leading run axis) to restore into.
    experiment: what defines the sweep (its configuration, algorithm, seeds
      and values) as JSON-able values: stored with the checkpoint, and a
      checkpoint of another experiment is refused on resume.
    rounds: the sweep's rounds; a checkpoint is at most at this round.
    start: `start() -> Carry`, the sweep's initial state, whose data counts a
      restored state must hold (`check_restored`); None: not checked.
    clients: the number of clients, which a history's client indices are below.
  """

  def __init__(self, path: str, every: int, resume: bool,
               template: Callable[[], engine.Carry], experiment: dict[str, Any],
               rounds: int, start: Callable[[], engine.Carry] | None = None,
               clients: int | None = None):
    if every < 0:
      raise ValueError(f"checkpoint_every must be >= 0, got {every}.")
    self.path, self.every, self.resume, self.template = path, every, resume, template
    self.rounds, self.start, self.clients = rounds, start, clients
    self.experiment = json.loads(json.dumps(experiment, default=repr))

  def due(self, rounds_done: int) -> bool:
    return bool(self.every) and rounds_done % self.every == 0

  def save(self, carry: engine.Carry, rounds_done: int,
           histories: Sequence[Sequence[records.RoundRecord]], seconds: float) -> None:
    payload = {"round": rounds_done, "seconds": seconds,
               "experiment": json.dumps(self.experiment),
               "history": json.dumps([[h.to_json() for h in hist] for hist in histories]),
               "carry": serialization.to_state_dict(_as_pair(jax.tree.map(np.asarray,
                                                                         carry)))}
    os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
    records.write_file(self.path, serialization.msgpack_serialize(payload))

  def restore(self) -> Restored | None:
    """`(carry, rounds_done, histories, seconds)`, or None without a checkpoint.

    Raises:
      ValueError: naming the file, for a corrupt checkpoint, one of another
        experiment, or one whose contents do not fit it (`check_restored`).
    """
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
    template = self.template()
    try:
      carry = engine.Carry(*serialization.from_state_dict(_as_pair(template),
                                                          payload["carry"]))
      histories = [[records.RoundRecord.from_json(h) for h in hist]
                   for hist in json.loads(payload["history"])]
      rounds_done, seconds = payload["round"], payload["seconds"]
    except Exception as e:  # pylint: disable=broad-except
      raise _corrupt(self.path, e) from None
    counts = state_counts(self.start()) if self.start else None
    check_restored(self.path, carry, rounds_done, histories, seconds, template,
                   self.rounds, counts, self.clients)
    return carry, rounds_done, histories, float(seconds)
