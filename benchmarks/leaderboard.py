"""PFLlib's Fashion-MNIST leaderboard, or a timed slice of it.

The leaderboard is `pflax-run --leaderboard pfllib-fmnist`: each of PFLlib's
baselines that pflax has (the presets `pfllib-fmnist-pathological` and
`pfllib-fmnist-dirichlet`), both settings, 3 seeds, 2,000 rounds, the 3 seeds of
an algorithm in both settings side by side in one program
(`pflax.simulate.sweep_settings`).
This script runs it through the same code (`pflax/_src/cli/leaderboard.py`),
smaller where asked, and projects its time:

  python benchmarks/leaderboard.py                     # the whole leaderboard
  python benchmarks/leaderboard.py --slice             # 100 rounds, timed
  python benchmarks/leaderboard.py --slice --quick     # seconds on a CPU
  python benchmarks/leaderboard.py --slice --json PATH
  python benchmarks/leaderboard.py --slice --apart     # each setting on its own
  python benchmarks/leaderboard.py --slice --precision bf16 --algorithms fedavg
  python benchmarks/leaderboard.py --slice --data-dir DIR   # Fashion-MNIST's IDX files

It writes the Markdown table (`--out`) of pflax's best personalized test accuracy
(mean and standard deviation over the seeds) next to PFLlib's published numbers,
with each sweep's seconds per round (the rounds after the first and before the
last, so compilation and the final evaluation are left out; the settings of one
sweep share it), and projects the whole leaderboard's time at 2,000 rounds: the
sum over the sweeps of seconds per round times 2,000. Interrupted (Ctrl-C, or
SIGINT from `benchmarks/gpu.py` when its time budget is spent), it writes the
finished rows with `"interrupted": true` and no projection.
"""

import argparse
import json
import signal
import time

from pflax import train
from pflax._src.cli import leaderboard
from pflax._src.cli import parser

BOARD = "pfllib-fmnist"
LEADERBOARD_ROUNDS = 2000
SLICE_ROUNDS = 100


def run_flags(args: argparse.Namespace) -> list[str]:
  """The `pflax-run` flags of this script's: `--slice`'s or `--quick`'s sizes,
  then the sizes and algorithms given."""
  sizes = {}
  if args.slice:
    sizes = {"rounds": SLICE_ROUNDS, "eval_every": SLICE_ROUNDS}
  if args.quick:
    sizes = {"rounds": 3, "eval_every": 3, "samples_per_client": 30}
  sizes.update({k: getattr(args, k) for k in ("rounds", "eval_every",
                                              "samples_per_client") if getattr(args, k)})
  flags = ["--leaderboard", BOARD, "--no-progress"]
  for key, value in sizes.items():
    flags += [parser.flag(key), str(value)]
  for key in PASSED_ON:
    if getattr(args, key, None):
      flags += [parser.flag(key), str(getattr(args, key))]
  return flags + (["--algorithms", *args.algorithms] if args.algorithms else [])


PASSED_ON = ("precision", "data_dir")
"""This script's flags handed to `pflax-run` as they are."""


def rows_of(flags: list[str], apart: bool = False, rows: list[dict] | None = None
            ) -> list[dict]:
  """The leaderboard's rows, as `pflax-run flags` runs them (`apart`: each
  setting in sweeps of its own), appended to `rows` as their sweeps end (what an
  interruption keeps)."""
  args = parser.parser().parse_args(flags)
  board = leaderboard.board(args.leaderboard)
  return leaderboard.run(board, leaderboard.invocations(
      board, args, parser.given_flags(flags)), [] if rows is None else rows, apart)


def projected_hours(rows: list[dict]) -> float:
  """The whole leaderboard's time at 2,000 rounds from the measured rounds: each
  sweep's seconds per round once (a row holds its share of its sweep's, which the
  settings of its `sweep` ran side by side)."""
  return leaderboard.sweep_seconds(rows) * LEADERBOARD_ROUNDS / 3600.0


def slice_report(rows: list[dict], flags: list[str], apart: bool, seconds: float,
                 interrupted: bool) -> dict:
  """The `--json` report: the rows, the projection (None when `interrupted`: the
  rows are not the whole slice), the flags and the wall seconds."""
  return {"rows": rows, "projected_hours": None if interrupted else projected_hours(rows),
          "flags": flags, "apart": apart, "wall_seconds": seconds,
          "interrupted": interrupted}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--slice", action="store_true",
                 help=f"{SLICE_ROUNDS} rounds, timed, projected to "
                      f"{LEADERBOARD_ROUNDS}")
  p.add_argument("--quick", action="store_true",
                 help="tiny: 3 rounds of 30 samples per client (CPU, CI)")
  p.add_argument("--rounds", type=int, default=None)
  p.add_argument("--samples-per-client", type=int, default=None)
  p.add_argument("--eval-every", type=int, default=None)
  p.add_argument("--algorithms", nargs="+", default=None)
  p.add_argument("--precision", choices=train.PRECISIONS, default=None,
                 help="pflax-run's --precision (default: the presets', float32)")
  p.add_argument("--data-dir", default=None,
                 help="pflax-run's --data-dir: a folder of Fashion-MNIST's IDX files "
                      "where Debian's package is not installed")
  p.add_argument("--apart", action="store_true",
                 help="each setting in sweeps of its own, one after the other (as "
                      "before sweep_settings), to compare")
  p.add_argument("--json", default=None, metavar="PATH")
  p.add_argument("--out", default=None, metavar="PATH", help="the Markdown table")
  args = p.parse_args(argv)
  flags = run_flags(args)
  # A process started in the background inherits SIGINT ignored; benchmarks/gpu.py
  # interrupts a slice with it when its time budget is spent.
  signal.signal(signal.SIGINT, signal.default_int_handler)
  started, rows = time.perf_counter(), []
  try:
    rows_of(flags, args.apart, rows)
  except KeyboardInterrupt:
    write(args, slice_report(rows, flags, args.apart, time.perf_counter() - started,
                             interrupted=True))
    raise
  write(args, slice_report(rows, flags, args.apart, time.perf_counter() - started,
                           interrupted=False))


def write(args: argparse.Namespace, report: dict) -> None:
  """Prints the table and the projection, and writes them to `--out` and the
  report to `--json`, where given."""
  projection = ("not projected: interrupted before the slice's end"
                if report["interrupted"] else f"{report['projected_hours']:.2f} h")
  text = leaderboard.table(leaderboard.board(BOARD), report["rows"]) + (
      f"\nProjected whole leaderboard ({LEADERBOARD_ROUNDS} rounds): {projection}\n")
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)


if __name__ == "__main__":
  main()
