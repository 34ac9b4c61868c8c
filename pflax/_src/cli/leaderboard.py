"""`pflax-run --leaderboard NAME`: every algorithm of a published leaderboard in
each of its settings, in a table next to the published numbers.

A leaderboard (`presets.LEADERBOARDS`) is a few presets, its settings. Each
setting is resolved as `--preset SETTING` with the flags given, the
leaderboard's seeds unless `--seeds` is given (`invocations`). When the
settings' configurations differ only in their partition
(`simulate.PARTITION_FIELDS`) and they run the same algorithms and seeds
(`side_by_side`), each algorithm runs every setting's seeds as one sweep
(`simulate.sweep_settings`: one round of the sweep is a round of every setting
and seed); otherwise the settings run one after the other, each algorithm's
seeds of a setting as one sweep. A row is pflax's best personalized test
accuracy over the evaluated rounds (percent; mean and standard deviation over
the seeds), the published number, and its sweep's seconds per round (rounds 2 to
R - 1: the first compiles the round, the last evaluates and, when it is the
first to evaluate, compiles the evaluation), shared by the settings that ran side
by side. `benchmarks/leaderboard.py` times the same rows.
"""

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from pflax._src.cli import config as config_lib
from pflax._src.cli import messages
from pflax._src.cli import parser
from pflax._src.cli import presets
from pflax._src.cli import report
from pflax._src.cli import runs
from pflax._src.cli import runtime
from pflax._src.simulation import experiment
from pflax._src.simulation import records
from pflax._src.simulation import simulate

TABLE = "leaderboard.md"
JSON = "leaderboard.json"
NOT_WITH = ("preset", "config", "sweep", "tune", "flower", "sequential",
            "checkpoint_every", "resume")
"""Flags `--leaderboard` refuses: it runs its own presets, each algorithm's seeds
as one sweep, without checkpoints."""

Invocations = Mapping[str, config_lib.Invocation]
"""`{setting: its invocation}`, in the leaderboard's order."""


def board(name: str) -> presets.Leaderboard:
  """The leaderboard `name`; a one-line error listing the valid names otherwise."""
  try:
    return presets.leaderboard(name)
  except ValueError as e:
    raise messages.fail(f"--leaderboard: {e}") from None


def invocations(leaderboard: presets.Leaderboard, args: argparse.Namespace,
                given: Collection[str]) -> Invocations:
  """Each setting's invocation: `--preset SETTING` with the flags `given`
  (`parser.given_flags`), the leaderboard's seeds unless `--seeds` is given.
  A flag of `NOT_WITH` is a one-line error. `args` is only read."""
  refused = [parser.flag(f) for f in NOT_WITH if f in given]
  if refused:
    raise messages.fail(f"--leaderboard runs its presets, each algorithm's seeds as "
                        f"one sweep; it cannot be combined with {refused[0]}")
  seeds = args.seeds if "seeds" in given else list(leaderboard.seeds)
  return {setting: config_lib.invocation_from_args(
      argparse.Namespace(**{**vars(args), "preset": preset, "seeds": seeds}),
      {*given, "seeds"}) for setting, preset in leaderboard.settings.items()}


def configs(invocations_: Invocations) -> dict[str, dict[str, Any]]:
  """`{setting: results.json's config}`: every value each setting runs with."""
  return {s: config_lib.config_dict(i) for s, i in invocations_.items()}


def seconds_per_round(ends: Sequence[float]) -> float | None:
  """The mean seconds of rounds 2 to R - 1 from every round's end time (of all
  rounds when R <= 2); None for one round."""
  timed = ends[:-1] if len(ends) > 2 else ends
  return (timed[-1] - timed[0]) / (len(timed) - 1) if len(timed) > 1 else None


def sweep_seconds(rows: Sequence[Mapping[str, Any]]) -> float:
  """Seconds per round of the sweeps that ran `rows`, each sweep once: a row
  holds its sweep's, shared by the settings of its `sweep` (NaN where a row's is
  unknown)."""
  return sum((r["seconds_per_round"] or float("nan")) / len(r["sweep"]) for r in rows)


def side_by_side(invocations_: Invocations) -> bool:
  """Whether the settings run side by side: their configurations agree but in
  `simulate.PARTITION_FIELDS`, and so do their algorithms and seeds."""
  first, *rest = invocations_.values()
  return (experiment.differing_field({s: i.config for s, i in invocations_.items()})
          is None and all((i.algorithms, i.seeds) == (first.algorithms, first.seeds)
                          for i in rest))


def groups(invocations_: Invocations, apart: bool = False) -> list[list[str]]:
  """The settings of each sweep: all of them at once when `side_by_side` (and
  not `apart`), else one by one, in the leaderboard's order."""
  if not apart and side_by_side(invocations_):
    return [list(invocations_)]
  return [[setting] for setting in invocations_]


def timed_sweep(algorithm: str, invocations_: Invocations,
                setups: Mapping[str, Mapping[int, experiment.Setup]], label: str
                ) -> tuple[dict[str, list[records.RunRecord]], float | None]:
  """One algorithm's seeds of the settings `invocations_` as one sweep, with a
  progress bar: the runs by setting, and the seconds per round
  (`seconds_per_round`), shared by the settings."""
  first = next(iter(invocations_.values()))
  bar = report.progress(first.config.rounds, label, first.progress)
  ends = []

  def on_round(t, rounds):
    del t, rounds
    ends.append(time.perf_counter())
    bar.update(1)

  try:
    out = simulate.sweep_settings(
        algorithm, {s: i.config for s, i in invocations_.items()}, list(first.seeds),
        setups=setups, on_round=on_round, mesh=runtime.mesh(first.devices))
  except ValueError as e:
    raise messages.fail(str(e)) from None
  bar.close()
  return out, seconds_per_round(ends)


def row(setting: str, algorithm: str, invocation: config_lib.Invocation,
        runs_: Sequence[records.RunRecord], seconds: float | None,
        published: float | None, sweep: Sequence[str]) -> dict[str, Any]:
  """A row of the table: the seeds' best personalized accuracy (percent), mean
  and standard deviation, next to the published number; `sweep` the settings
  whose seeds ran in the row's sweep, sharing its `seconds` per round."""
  best = [100.0 * run.summary().best for run in runs_]
  return {"algorithm": algorithm, "setting": setting, "seeds": len(runs_),
          "rounds": invocation.config.rounds, "seconds_per_round": seconds,
          "sweep": list(sweep), "accuracy_mean": float(np.mean(best)),
          "accuracy_std": float(np.std(best)), "published": published}


def _place(invocations_: Invocations) -> Callable[[Mapping[str, Any]], tuple[int, int]]:
  """A row's place in the table: its setting's, then its algorithm's in that
  setting."""
  settings = list(invocations_)
  return lambda r: (settings.index(r["setting"]),
                    invocations_[r["setting"]].algorithms.index(r["algorithm"]))


def run(leaderboard: presets.Leaderboard, invocations_: Invocations,
        rows: list[dict[str, Any]], apart: bool = False) -> list[dict[str, Any]]:
  """Every algorithm of every group of settings (`groups`), each a sweep of the
  group's seeds over the settings' federations (prepared once per setting);
  each row is printed as its sweep ends and kept in `rows` (what Ctrl-C keeps)
  in the table's order: settings outer, algorithms inner. `apart` runs the
  settings one after the other even where they could share sweeps (what
  `benchmarks/gpu.py` compares against). Returns `rows`."""
  for group in groups(invocations_, apart):
    members = {s: invocations_[s] for s in group}
    setups = {s: runs.prepare(i) for s, i in members.items()}
    first = members[group[0]]
    for algorithm in first.algorithms:
      label = f"{algorithm} {' + '.join(group)} x{len(first.seeds)}"
      by_setting, seconds = timed_sweep(algorithm, members, setups, label)
      for setting, invocation in members.items():
        paper = presets.get(leaderboard.settings[setting]).paper
        r = row(setting, algorithm, invocation, by_setting[setting], seconds,
                paper.get(algorithm), group)
        rows.append(r)
        print(f"{algorithm} {setting} x{len(first.seeds)}: best {_accuracy(r)} "
              f"({leaderboard.source} {_number(r['published'])}), "
              f"{_number(r['seconds_per_round'], '.3f')} s / round", flush=True)
      rows.sort(key=_place(invocations_))
  return rows


def _number(value: float | None, spec: str = "") -> str:
  return "—" if value is None else format(value, spec)


def _accuracy(r: Mapping[str, Any]) -> str:
  return f"{r['accuracy_mean']:.2f} ± {r['accuracy_std']:.2f}"


def table(leaderboard: presets.Leaderboard, rows: Sequence[Mapping[str, Any]]) -> str:
  """Markdown: pflax's accuracy next to the published one, and seconds per round
  (of the row's sweep, shared by the settings it ran side by side)."""
  lines = [f"| algorithm | setting | rounds | seeds | pflax (mean ± std) | "
           f"{leaderboard.source} | s / round |", "|---|---|---:|---:|---:|---:|---:|"]
  lines += [f"| {r['algorithm']} | {r['setting']} | {r['rounds']} | {r['seeds']} | "
            f"{_accuracy(r)} | {_number(r['published'])} | "
            f"{_number(r['seconds_per_round'], '.3f')} |" for r in rows]
  shared = [r["sweep"] for r in rows if len(r["sweep"]) > 1]
  if shared:
    lines += ["", f"s / round: each algorithm's one sweep of the settings "
                  f"{', '.join(shared[0])} side by side, shared by their rows."]
  return "\n".join(lines) + "\n"


def write(leaderboard: presets.Leaderboard, invocations_: Invocations,
          rows: Sequence[Mapping[str, Any]], out: str) -> None:
  """Writes `out/leaderboard.md` (`table`) and `out/leaderboard.json`
  (`{"leaderboard", "source", "rows", "configs"}`, `row`'s rows), and prints the
  table."""
  text = table(leaderboard, rows)
  data = {"leaderboard": leaderboard.name, "source": leaderboard.source,
          "rows": list(rows), "configs": configs(invocations_)}
  records.write_file(os.path.join(out, TABLE), text.encode())
  records.write_file(os.path.join(out, JSON), json.dumps(data, indent=1).encode())
  print(text)
  print(f"wrote {os.path.join(out, TABLE)} and {os.path.join(out, JSON)}")


def run_and_write(leaderboard: presets.Leaderboard, invocations_: Invocations
                  ) -> None:
  """`run`, then process 0 `write`s to `--out`; on Ctrl-C, the finished rows."""
  out = next(iter(invocations_.values())).out
  rows = []
  try:
    run(leaderboard, invocations_, rows)
  except KeyboardInterrupt:
    if rows and jax.process_index() == 0:
      write(leaderboard, invocations_, rows, out)
      print(f"pflax-run: interrupted; wrote the {len(rows)} finished rows",
            file=sys.stderr)
    raise
  if jax.process_index() == 0:
    write(leaderboard, invocations_, rows, out)
