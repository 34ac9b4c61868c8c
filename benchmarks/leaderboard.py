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

It writes the Markdown table (`--out`) of pflax's best personalized test accuracy
(mean and standard deviation over the seeds) next to PFLlib's published numbers,
with each sweep's seconds per round (the rounds after the first and before the
last, so compilation and the final evaluation are left out; the settings of one
sweep share it), and projects the whole leaderboard's time at 2,000 rounds: the
sum over the sweeps of seconds per round times 2,000.
"""

import argparse
import json
import time

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
  return flags + (["--algorithms", *args.algorithms] if args.algorithms else [])


def rows_of(flags: list[str], apart: bool = False) -> list[dict]:
  """The leaderboard's rows, as `pflax-run flags` runs them (`apart`: each
  setting in sweeps of its own)."""
  args = parser.parser().parse_args(flags)
  board = leaderboard.board(args.leaderboard)
  return leaderboard.run(board, leaderboard.invocations(
      board, args, parser.given_flags(flags)), [], apart)


def projected_hours(rows: list[dict]) -> float:
  """The whole leaderboard's time at 2,000 rounds from the measured rounds: each
  sweep's seconds per round once (a row holds its share of its sweep's, which the
  settings of its `sweep` ran side by side)."""
  return leaderboard.sweep_seconds(rows) * LEADERBOARD_ROUNDS / 3600.0


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
  p.add_argument("--apart", action="store_true",
                 help="each setting in sweeps of its own, one after the other (as "
                      "before sweep_settings), to compare")
  p.add_argument("--json", default=None, metavar="PATH")
  p.add_argument("--out", default=None, metavar="PATH", help="the Markdown table")
  args = p.parse_args(argv)
  flags = run_flags(args)
  started = time.perf_counter()
  rows = rows_of(flags, args.apart)
  report = {"rows": rows, "projected_hours": projected_hours(rows),
            "flags": flags, "apart": args.apart,
            "wall_seconds": time.perf_counter() - started}
  text = leaderboard.table(leaderboard.board(BOARD), rows) + (
      f"\nProjected whole leaderboard ({LEADERBOARD_ROUNDS} rounds): "
      f"{report['projected_hours']:.2f} h\n")
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)


if __name__ == "__main__":
  main()
