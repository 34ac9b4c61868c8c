"""Typed records of runs, read and written as `results.json`.

`results.json` is `{"config": {...}, "class_counts": [[...]], "runs": [run,
...]}`; a run is `{"algorithm", "seed", "personalized_accuracy": {"best",
"final", "client_mean", "client_std"}, "global_accuracy": ... | null,
"exclusive_accuracy": ... | null, "faulty_uploads", "history": [round, ...],
"seconds", "output_norms", "hyperparameter"?}` and a round `{"round",
"train_loss", "dropped_clients", "faulty_clients", "<kind>_accuracy",
"<kind>_client_mean", "<kind>_client_std"}` for each evaluated kind.
"""

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pflax._src import algorithm as alg

FINAL_WINDOW = 5
"""`final` accuracy: the mean over the last this many evaluations."""


@dataclasses.dataclass(frozen=True)
class Accuracy:
  """One round's accuracy of one kind of model (`pflax.algorithms.EVALUATED`).

  Attributes:
    accuracy: sample-weighted (all correct test samples over all test samples).
    client_mean, client_std: the unweighted mean and standard deviation (ddof
      0) over clients of each client's own accuracy, as the FedClassAvg paper
      reports them; clients without test samples are left out.
  """
  accuracy: float
  client_mean: float
  client_std: float

  @classmethod
  def of(cls, correct: np.ndarray, tests: np.ndarray) -> "Accuracy":
    """From `(M,)` correct test samples and test samples per client."""
    own = correct[tests > 0] / tests[tests > 0]
    return cls(float(np.sum(correct) / np.sum(tests)), float(np.mean(own)),
               float(np.std(own)))


@dataclasses.dataclass(frozen=True)
class RoundRecord:
  """One round of one run.

  Attributes:
    round: the round number, from 1.
    train_loss: mean local loss over the clients that were aggregated.
    dropped_clients: clients that took part but were not aggregated
      (non-finite uploads, the injected faults among them).
    faulty_clients: the injected faults (`ExperimentConfig.faulty_clients`).
    accuracies: `{kind: Accuracy}` in rounds that were evaluated, else empty.
  """
  round: int
  train_loss: float
  dropped_clients: tuple[int, ...] = ()
  faulty_clients: tuple[int, ...] = ()
  accuracies: Mapping[str, Accuracy] = dataclasses.field(default_factory=dict)

  def accuracy(self, kind: str = "personalized") -> float | None:
    """The round's `kind` accuracy, None if not evaluated."""
    return self.accuracies[kind].accuracy if kind in self.accuracies else None

  def to_json(self) -> dict[str, Any]:
    out = {"round": self.round, "train_loss": self.train_loss,
           "dropped_clients": list(self.dropped_clients),
           "faulty_clients": list(self.faulty_clients)}
    for kind, acc in self.accuracies.items():
      out.update({f"{kind}_accuracy": acc.accuracy,
                  f"{kind}_client_mean": acc.client_mean,
                  f"{kind}_client_std": acc.client_std})
    return out

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> "RoundRecord":
    # Files written before the per-client statistics existed have none: NaN.
    accuracies = {kind: Accuracy(d[f"{kind}_accuracy"],
                                 d.get(f"{kind}_client_mean", float("nan")),
                                 d.get(f"{kind}_client_std", float("nan")))
                  for kind in alg.EVALUATED if f"{kind}_accuracy" in d}
    return cls(d["round"], d["train_loss"], tuple(d.get("dropped_clients", ())),
               tuple(d.get("faulty_clients", ())), accuracies)


@dataclasses.dataclass(frozen=True)
class Summary:
  """A run's accuracy of one kind: `best` over rounds, `final` (mean of the last
  `FINAL_WINDOW` evaluations), with `client_mean` and `client_std` averaged
  over the same window."""
  best: float
  final: float
  client_mean: float
  client_std: float

  @classmethod
  def of(cls, kind: str, history: Sequence[RoundRecord]) -> "Summary | None":
    """The summary of `kind` over a history; None if never evaluated."""
    evaluated = [h.accuracies[kind] for h in history if kind in h.accuracies]
    if not evaluated:
      return None
    final = evaluated[-FINAL_WINDOW:]
    mean = lambda field: float(np.mean([getattr(a, field) for a in final]))
    return cls(float(max(a.accuracy for a in evaluated)), mean("accuracy"),
               mean("client_mean"), mean("client_std"))


@dataclasses.dataclass(frozen=True)
class RunRecord:
  """One run: an algorithm with one seed (and one value of a swept hyperparameter).

  Attributes:
    algorithm: the algorithm's name.
    seed: the run's seed.
    history: one `RoundRecord` per round.
    seconds: wall time of the rounds (of a sweep: shared by its runs).
    output_norms: `(M, K)` norms of the personalized output layers' weight
      vectors after the last round (empty if the file had none).
    hyperparameter: `{name: value}` of a sweep's swept hyperparameter, else empty.
  """
  algorithm: str
  seed: int
  history: tuple[RoundRecord, ...]
  seconds: float
  output_norms: np.ndarray
  hyperparameter: Mapping[str, float] = dataclasses.field(default_factory=dict)

  def summary(self, kind: str = "personalized") -> Summary | None:
    """`Summary` of the run's `kind` accuracy, None if not evaluated."""
    return Summary.of(kind, self.history)

  @property
  def label(self) -> str:
    """The algorithm's name, with the swept hyperparameter's value if any."""
    swept = ", ".join(f"{k}={v:g}" for k, v in self.hyperparameter.items())
    return f"{self.algorithm} ({swept})" if swept else self.algorithm

  @property
  def faulty_uploads(self) -> int:
    return sum(len(h.faulty_clients) for h in self.history)

  def curve(self, kind: str = "personalized") -> tuple[list[int], list[float]]:
    """Rounds and accuracies of the evaluated rounds."""
    points = [(h.round, h.accuracy(kind)) for h in self.history
              if kind in h.accuracies]
    return [p[0] for p in points], [p[1] for p in points]

  def to_json(self) -> dict[str, Any]:
    summaries = {f"{kind}_accuracy": (s and dataclasses.asdict(s)) for kind in
                 alg.EVALUATED for s in [self.summary(kind)]}
    out = {"algorithm": self.algorithm, "seed": self.seed, **summaries,
           "faulty_uploads": self.faulty_uploads,
           "history": [h.to_json() for h in self.history], "seconds": self.seconds,
           "output_norms": np.asarray(self.output_norms).tolist()}
    if self.hyperparameter:
      out["hyperparameter"] = dict(self.hyperparameter)
    return out

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> "RunRecord":
    return cls(d["algorithm"], d["seed"],
               tuple(RoundRecord.from_json(h) for h in d["history"]), d["seconds"],
               np.asarray(d.get("output_norms", ()), np.float32),
               d.get("hyperparameter", {}))


@dataclasses.dataclass(frozen=True)
class Results:
  """A `results.json`: the configuration, the class counts of the first seed's
  partition, and the runs."""
  config: Mapping[str, Any]
  class_counts: np.ndarray
  runs: tuple[RunRecord, ...]

  def to_json(self) -> dict[str, Any]:
    return {"config": dict(self.config),
            "class_counts": np.asarray(self.class_counts).tolist(),
            "runs": [r.to_json() for r in self.runs]}

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> "Results":
    return cls(d["config"], np.asarray(d["class_counts"]),
               tuple(RunRecord.from_json(r) for r in d["runs"]))

  def save(self, path: str) -> None:
    """Writes the results as JSON to `path`, atomically (a temporary file renamed
    over it), so a reader never sees a partial file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(self.to_json(), f, indent=1)
    os.replace(tmp, path)

  @classmethod
  def load(cls, path: str) -> "Results":
    """Reads a `results.json`."""
    with open(path, encoding="utf-8") as f:
      return cls.from_json(json.load(f))
