"""Typed records of runs, read and written as `results.json`.

`results.json` is `{"config": {...}, "class_counts": [[...]] | null, "runs": [run,
...]}`; a run is `{"algorithm", "seed", "personalized_accuracy": summary,
"global_accuracy": summary | null, "exclusive_accuracy": summary | null,
"faulty_uploads", "history": [round, ...], "seconds", "output_norms",
"hyperparameter"?}`, a summary (`Summary`) `{"best", "final", "last",
"client_mean", "client_std", "final_window"}`: the best evaluation, the mean of
the last `final_window` (`min(FINAL_WINDOW, evaluations)`) evaluations, the
last evaluation, and the per-client mean and std averaged over the same window;
and a round `{"round", "train_loss", "dropped_clients", "faulty_clients",
"<kind>_accuracy", "<kind>_client_mean", "<kind>_client_std"}` for each
evaluated kind. Summaries are recomputed from the history when a file is read,
so files written before a summary field existed read the same.
"""

import dataclasses
import json
import os
import secrets
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from pflax._src.methods import algorithm as alg

FINAL_WINDOW = 5
"""`final` accuracy: the mean over the last this many evaluations."""


def _mean_std(values: Sequence[float]) -> str:
  """`mean ± std` of accuracies in %, or the one accuracy if there is one."""
  if len(values) == 1:
    return f"{100 * values[0]:.2f}"
  return f"{100 * np.mean(values):.2f} ± {100 * np.std(values):.2f}"


def write_file(path: str, content: bytes) -> None:
  """Writes `content` to `path` atomically and without following symlinks.

  The bytes go to a new temporary file of an unguessable name in `path`'s
  folder, created exclusively and never through a symlink (`O_EXCL |
  O_NOFOLLOW`), synced, then renamed over `path` (a rename replaces a symlink
  at `path`, it does not follow it). On any failure, a full disk or Ctrl-C
  included, the temporary file is removed: `path` holds its old content or the
  new, never a part, and nothing outside the folder is written.

  Raises:
    OSError: the file cannot be written; its `filename` is `path`.
  """
  folder, name = os.path.split(path)
  tmp = os.path.join(folder, f".{name}.{secrets.token_hex(8)}.tmp")
  flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
  try:
    fd = os.open(tmp, flags, 0o644)
  except OSError as e:
    raise OSError(e.errno, e.strerror, path) from None
  try:
    try:
      view = memoryview(content)
      while view:
        view = view[os.write(fd, view):]
      os.fsync(fd)
    finally:
      os.close(fd)
    os.replace(tmp, path)
  except BaseException as e:
    os.unlink(tmp)
    if isinstance(e, OSError):
      raise OSError(e.errno, e.strerror, path) from None
    raise


def write_json(path: str, value: Any) -> None:
  """Writes `value` as JSON to `path` atomically (`write_file`): a reader never
  sees a partial file, and a symlink planted at `path` is replaced, not followed."""
  write_file(path, json.dumps(value, indent=1).encode("utf-8"))


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
    epsilon: under client-level DP, eps(delta) spent after this round
      (docs/privacy.md); None (and absent from the JSON) otherwise.
    evaluated_clients: in a federation's evaluated rounds, the clients whose
      test samples `accuracies` count (those that replied and hold test
      samples: a node that is gone or hangs is left out); None (and absent
      from the JSON) where every client with test samples is counted, as in
      `pflax.simulate`.
  """
  round: int
  train_loss: float
  dropped_clients: tuple[int, ...] = ()
  faulty_clients: tuple[int, ...] = ()
  accuracies: Mapping[str, Accuracy] = dataclasses.field(default_factory=dict)
  epsilon: float | None = None
  evaluated_clients: tuple[int, ...] | None = None

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
    if self.epsilon is not None:
      out["epsilon"] = self.epsilon
    if self.evaluated_clients is not None:
      out["evaluated_clients"] = list(self.evaluated_clients)
    return out

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> "RoundRecord":
    # Files written before the per-client statistics existed have none: NaN.
    accuracies = {kind: Accuracy(d[f"{kind}_accuracy"],
                                 d.get(f"{kind}_client_mean", float("nan")),
                                 d.get(f"{kind}_client_std", float("nan")))
                  for kind in alg.EVALUATED if f"{kind}_accuracy" in d}
    return cls(d["round"], d["train_loss"], tuple(d.get("dropped_clients", ())),
               tuple(d.get("faulty_clients", ())), accuracies, d.get("epsilon"),
               _clients(d.get("evaluated_clients")))


def _clients(listed: Sequence[int] | None) -> tuple[int, ...] | None:
  return None if listed is None else tuple(int(i) for i in listed)


@dataclasses.dataclass(frozen=True)
class Summary:
  """A run's accuracy of one kind of model over its evaluated rounds.

  Attributes:
    best: the highest accuracy of any evaluation.
    final: the mean accuracy of the last `final_window` evaluations, steadier
      than one round's.
    last: the accuracy of the last evaluation.
    client_mean, client_std: `Accuracy.client_mean` and `client_std`, averaged
      over the same evaluations as `final`.
    final_window: how many evaluations `final` averages,
      `min(FINAL_WINDOW, evaluations)`.
  """
  best: float
  final: float
  last: float
  client_mean: float
  client_std: float
  final_window: int

  @classmethod
  def of(cls, kind: str, history: Sequence[RoundRecord]) -> "Summary | None":
    """The summary of `kind` over a history; None if never evaluated.

    >>> history = [RoundRecord(t, 0.0, accuracies={"personalized": Accuracy(a, a, 0.0)})
    ...            for t, a in enumerate([0.5, 0.9, 0.7], start=1)]
    >>> s = Summary.of("personalized", history)
    >>> s.best, round(s.final, 4), s.last, s.final_window
    (0.9, 0.7, 0.7, 3)
    """
    evaluated = [h.accuracies[kind] for h in history if kind in h.accuracies]
    if not evaluated:
      return None
    final = evaluated[-FINAL_WINDOW:]
    mean = lambda field: float(np.mean([getattr(a, field) for a in final]))
    return cls(float(max(a.accuracy for a in evaluated)), mean("accuracy"),
               float(evaluated[-1].accuracy), mean("client_mean"),
               mean("client_std"), len(final))


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


def _table_row(label: str, runs: Sequence[RunRecord]) -> str:
  """`Results.table`'s row of the runs (the seeds) of one label."""
  cell = lambda kind, field: (_mean_std([getattr(r.summary(kind), field) for r in runs])
                              if runs[0].summary(kind) else "—")
  clients = lambda field: 100 * np.mean([getattr(r.summary(), field) for r in runs])
  return (f"| {label} | {cell('personalized', 'best')} | {cell('personalized', 'final')} "
          f"| {cell('personalized', 'last')} | {clients('client_mean'):.2f} "
          f"({clients('client_std'):.2f}) | {cell('global', 'final')} | "
          f"{cell('exclusive', 'final')} |")


@dataclasses.dataclass(frozen=True)
class Results:
  """A `results.json`: the configuration, the class counts of the first seed's
  partition (None if not known), and the runs.

  `pflax-run` writes one; `Results.of` makes one of the runs that
  `pflax.simulate.run` and `sweep` return, to tabulate (`table`) or plot
  (`plot`, `pflax.simulate.plot_accuracy`, `plot_output_norms`) them.
  """
  config: Mapping[str, Any]
  class_counts: np.ndarray | None
  runs: tuple[RunRecord, ...]

  @classmethod
  def of(cls, runs: RunRecord | Iterable[RunRecord],
         config: Mapping[str, Any] | None = None,
         class_counts: np.ndarray | None = None) -> "Results":
    """The results of a run or runs, with an optional config and `(M, K)` class
    counts (`Setup.federation.counts`)."""
    runs = (runs,) if isinstance(runs, RunRecord) else tuple(runs)
    counts = None if class_counts is None else np.asarray(class_counts)
    return cls(dict(config or {}), counts, runs)

  def table(self) -> str:
    """A Markdown table of the accuracies (%), one row per `RunRecord.label`, each
    cell the mean ± std over seeds (with one seed, its accuracy), with a caption
    below saying what they are.

    "final" is `Summary.final` (the mean of the last `final_window` evaluations),
    "last" the last evaluation; "per client" is the final window's unweighted mean
    over clients of the personalized models' accuracies with their std over
    clients in parentheses, averaged over seeds; "exclusive" is FedDWA's
    exclusive models, one per client.

    >>> history = [RoundRecord(t, 0.0, accuracies={"personalized": Accuracy(a, a, 0.0)})
    ...            for t, a in enumerate([0.5, 0.9, 0.7], start=1)]
    >>> table = Results.of(RunRecord("local", 0, history, 1.0, np.zeros(0))).table()
    >>> lines = table.splitlines()
    >>> print(lines[2])
    | local | 90.00 | 70.00 | 70.00 | 70.00 (0.00) | — | — |
    >>> print(lines[-1])
    Accuracy (%), one seed; final = mean of the last 3 evaluations, last = ...
    """
    lines = ["| algorithm | personalized best | personalized final | personalized last "
             "| per client final: mean (std) | global final | exclusive final |",
             "|---|---|---|---|---|---|---|"]
    for label in dict.fromkeys(r.label for r in self.runs):
      lines.append(_table_row(label, [r for r in self.runs if r.label == label]))
    windows = sorted({s.final_window for r in self.runs for s in [r.summary()] if s})
    window = (f"{windows[0]} to {windows[-1]} evaluations" if len(windows) > 1
              else f"{windows[0]} evaluations" if windows and windows[0] > 1
              else "evaluation")
    seeds = len({r.seed for r in self.runs})
    spread = "one seed" if seeds == 1 else f"mean ± std over {seeds} seeds"
    caption = (f"Accuracy (%), {spread}; final = mean of the last {window}, "
               "last = the last evaluation.")
    return "\n".join(lines + ["", caption])

  def to_json(self) -> dict[str, Any]:
    counts = self.class_counts
    return {"config": dict(self.config),
            "class_counts": None if counts is None else np.asarray(counts).tolist(),
            "runs": [r.to_json() for r in self.runs]}

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> "Results":
    counts = d.get("class_counts")
    return cls(d.get("config") or {}, None if counts is None else np.asarray(counts),
               tuple(RunRecord.from_json(r) for r in d["runs"]))

  def save(self, path: str) -> None:
    """Writes the results as JSON to `path`, atomically (`write_json`)."""
    write_json(path, self.to_json())

  @classmethod
  def load(cls, path: str) -> "Results":
    """Reads a `results.json`."""
    with open(path, encoding="utf-8") as f:
      return cls.from_json(json.load(f))
