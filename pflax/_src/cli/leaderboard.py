"""`pflax-run --leaderboard NAME`: every algorithm of a published leaderboard in
each of its settings, in a table next to the published numbers.

A leaderboard (`presets.LEADERBOARDS`) is a few presets, its settings. Each
setting is resolved as `--preset SETTING` with the flags given, the
leaderboard's seeds unless `--seeds` is given (`invocations`), and each of its
algorithms runs the seeds as one sweep (`simulate.sweep`: one round of the
sweep is a round of every seed). A row is pflax's best personalized test
accuracy over the evaluated rounds (percent; mean and standard deviation over
the seeds), the published number, and the sweep's seconds per round (rounds 2
to R - 1: the first compiles the round, the last evaluates and, when it is the
first to evaluate, compiles the evaluation). `benchmarks/leaderboard.py` times
the same rows.
"""

import argparse
import json
import os
import sys
import time
from collections.abc import Collection, Mapping, Sequence
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


def timed_sweep(algorithm: str, invocation: config_lib.Invocation,
                setups: Mapping[int, experiment.Setup], label: str
                ) -> tuple[list[records.RunRecord], float | None]:
  """One algorithm's seeds as one sweep, with a progress bar: the runs, and the
  seconds per round (`seconds_per_round`)."""
  config = invocation.config
  bar = report.progress(config.rounds, label, invocation.progress)
  ends = []

  def on_round(t, rounds):
    del t, rounds
    ends.append(time.perf_counter())
    bar.update(1)

  try:
    out = simulate.sweep(algorithm, config, list(invocation.seeds), setups=setups,
                         on_round=on_round, mesh=runtime.mesh(invocation.devices))
  except ValueError as e:
    raise messages.fail(str(e)) from None
  bar.close()
  return out, seconds_per_round(ends)


def row(setting: str, algorithm: str, invocation: config_lib.Invocation,
        runs_: Sequence[records.RunRecord], seconds: float | None,
        published: float | None) -> dict[str, Any]:
  """A row of the table: the seeds' best personalized accuracy (percent), mean
  and standard deviation, next to the published number."""
  best = [100.0 * run.summary().best for run in runs_]
  return {"algorithm": algorithm, "setting": setting, "seeds": len(runs_),
          "rounds": invocation.config.rounds, "seconds_per_round": seconds,
          "accuracy_mean": float(np.mean(best)), "accuracy_std": float(np.std(best)),
          "published": published}


def run(leaderboard: presets.Leaderboard, invocations_: Invocations,
        rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Every setting's algorithms, each a sweep of the seeds over the setting's
  federations (prepared once per setting); each row is printed and appended to
  `rows` as its sweep ends (what Ctrl-C keeps). Returns `rows`."""
  for setting, invocation in invocations_.items():
    paper = presets.get(leaderboard.settings[setting]).paper
    setups = runs.prepare(invocation)
    for algorithm in invocation.algorithms:
      label = f"{algorithm} {setting} x{len(invocation.seeds)}"
      rows.append(row(setting, algorithm, invocation,
                      *timed_sweep(algorithm, invocation, setups, label),
                      paper.get(algorithm)))
      r = rows[-1]
      print(f"{label}: best {_accuracy(r)} ({leaderboard.source} "
            f"{_number(r['published'])}), {_number(r['seconds_per_round'], '.3f')} "
            "s / round", flush=True)
  return rows


def _number(value: float | None, spec: str = "") -> str:
  return "—" if value is None else format(value, spec)


def _accuracy(r: Mapping[str, Any]) -> str:
  return f"{r['accuracy_mean']:.2f} ± {r['accuracy_std']:.2f}"


def table(leaderboard: presets.Leaderboard, rows: Sequence[Mapping[str, Any]]) -> str:
  """Markdown: pflax's accuracy next to the published one, and seconds per round."""
  lines = [f"| algorithm | setting | rounds | seeds | pflax (mean ± std) | "
           f"{leaderboard.source} | s / round |", "|---|---|---:|---:|---:|---:|---:|"]
  lines += [f"| {r['algorithm']} | {r['setting']} | {r['rounds']} | {r['seeds']} | "
            f"{_accuracy(r)} | {_number(r['published'])} | "
            f"{_number(r['seconds_per_round'], '.3f')} |" for r in rows]
  return "\n".join(lines) + "\n"


def write(leaderboard: presets.Leaderboard, invocations_: Invocations,
          rows: Sequence[Mapping[str, Any]], out: str) -> None:
  """Writes `out/leaderboard.md` (`table`) and `out/leaderboard.json`
  (`{"leaderboard", "source", "rows", "configs"}`), and prints the table."""
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
