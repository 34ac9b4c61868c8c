"""PFLlib's Fashion-MNIST leaderboard in one command, or a timed slice of it.

The leaderboard is each of PFLlib's baselines that pflax has (the presets
`pfllib-fmnist-pathological` and `pfllib-fmnist-dirichlet`), both settings,
3 seeds, 2,000 rounds. The 3 seeds of an algorithm and setting run side by side
in one program (`pflax.simulate.sweep`): one round of the sweep is a round of
every seed.

  python benchmarks/leaderboard.py                     # the whole leaderboard
  python benchmarks/leaderboard.py --slice             # 100 rounds, timed
  python benchmarks/leaderboard.py --slice --quick     # seconds on a CPU
  python benchmarks/leaderboard.py --slice --json PATH

The whole leaderboard writes a Markdown table (`--out`) of pflax's best test
accuracy over the evaluated rounds (the personalized models', mean and standard
deviation over the seeds) next to PFLlib's published numbers. `--slice` times
a round of each sweep (the rounds after the first and before the last, so
compilation and the final evaluation are left out)
and projects the whole leaderboard's time at 2,000 rounds: the sum over
algorithms and settings of seconds per round times 2,000.
"""

import argparse
import json
import time

import numpy as np

from pflax import simulate
from pflax._src.cli import presets

SETTINGS = ("pathological", "dirichlet")
SEEDS = (0, 1, 2)
LEADERBOARD_ROUNDS = 2000
SLICE_ROUNDS = 100


def config_of(setting: str, **overrides) -> simulate.ExperimentConfig:
  """The preset's configuration of `setting`, with `overrides`."""
  return simulate.ExperimentConfig(
      **{**presets.get(f"pfllib-fmnist-{setting}").config, **overrides})


def best_accuracy(run) -> float:
  """The best personalized test accuracy (percent) over the evaluated rounds."""
  return 100.0 * max(r.accuracies["personalized"].accuracy for r in run.history
                     if r.accuracies)


def sweep_row(algorithm: str, setting: str, config: simulate.ExperimentConfig,
              seeds=SEEDS) -> dict:
  """One sweep of the seeds: its seconds per round (after the first) and accuracies."""
  ends = []
  runs = simulate.sweep(algorithm, config, list(seeds),
                        on_round=lambda t, rounds: ends.append(time.perf_counter()))
  # Rounds 2 to R - 1: the first compiles the round, the last evaluates (and
  # compiles the evaluation when it is the first to evaluate).
  timed = ends[:-1] if len(ends) > 2 else ends
  per_round = ((timed[-1] - timed[0]) / (len(timed) - 1) if len(timed) > 1
               else float("nan"))
  accuracies = [best_accuracy(r) for r in runs]
  return {"algorithm": algorithm, "setting": setting, "seeds": len(seeds),
          "rounds": config.rounds, "seconds_per_round": per_round,
          "accuracy_mean": float(np.mean(accuracies)),
          "accuracy_std": float(np.std(accuracies)),
          "pfllib": presets.get(f"pfllib-fmnist-{setting}").paper[algorithm]}


def leaderboard(overrides: dict, algorithms=None) -> list[dict]:
  """Every algorithm of the leaderboard in both settings, 3 seeds side by side."""
  rows = []
  for setting in SETTINGS:
    preset = presets.get(f"pfllib-fmnist-{setting}")
    for algorithm in algorithms or preset.algorithms:
      rows.append(sweep_row(algorithm, setting, config_of(setting, **overrides)))
      print(json.dumps(rows[-1]), flush=True)
  return rows


def projected_hours(rows: list[dict]) -> float:
  """The whole leaderboard's time at 2,000 rounds from the measured rounds."""
  return sum(r["seconds_per_round"] for r in rows) * LEADERBOARD_ROUNDS / 3600.0


def table(rows: list[dict]) -> str:
  """Markdown: pflax's accuracy next to PFLlib's, and seconds per round."""
  lines = ["| algorithm | setting | rounds | pflax (mean ± std, 3 seeds) | PFLlib | "
           "s / round (3 seeds) |", "|---|---|---:|---:|---:|---:|"]
  lines += [f"| {r['algorithm']} | {r['setting']} | {r['rounds']} | "
            f"{r['accuracy_mean']:.2f} ± {r['accuracy_std']:.2f} | {r['pfllib']} | "
            f"{r['seconds_per_round']:.3f} |" for r in rows]
  return "\n".join(lines) + "\n"


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
  p.add_argument("--json", default=None, metavar="PATH")
  p.add_argument("--out", default=None, metavar="PATH", help="the Markdown table")
  args = p.parse_args(argv)
  rounds = LEADERBOARD_ROUNDS
  overrides = {}
  if args.slice:
    rounds = SLICE_ROUNDS
    overrides["eval_every"] = SLICE_ROUNDS
  if args.quick:
    rounds = 3
    overrides.update(samples_per_client=30, eval_every=3)
  overrides["rounds"] = args.rounds or rounds
  if args.samples_per_client:
    overrides["samples_per_client"] = args.samples_per_client
  if args.eval_every:
    overrides["eval_every"] = args.eval_every
  started = time.perf_counter()
  rows = leaderboard(overrides, args.algorithms)
  report = {"rows": rows, "projected_hours": projected_hours(rows),
            "config": {k: v for k, v in overrides.items()},
            "wall_seconds": time.perf_counter() - started}
  text = table(rows) + (f"\nProjected whole leaderboard ({LEADERBOARD_ROUNDS} rounds): "
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
