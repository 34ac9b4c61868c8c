"""Sweep speed: S seeds as one vmapped program against S sequential runs.

Each (algorithm, mode) runs in its own process, modes interleaved over
`--repeats` so that load on a shared machine hits both alike:

  sequential  `pflax.simulate.run` once per seed with the default strategy (on
              CPU the loop of jitted per-client programs), compiled programs
              reused across the seeds;
  vmapped     `pflax.simulate.sweep` over the S seeds (clients vmapped inside).

Reported per mode (medians over processes): the end-to-end time of the S runs
including compilation, the round-loop time alone (compiled), and the ratios
sequential / vmapped (> 1: the sweep is faster). The data are prepared before
timing in both modes.

Usage:
  python benchmarks/sweeps.py                           # fedavg cwfedavg feddwa, 3 seeds
  python benchmarks/sweeps.py --algorithms fedavg --rounds 20 --repeats 3
  python benchmarks/sweeps.py --quick                   # smoke run
"""

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time

MODES = ("sequential", "vmapped")


def worker(algorithm: str, mode: str, seeds: list[int], rounds: int,
           clients: int) -> dict[str, float]:
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_threefry_partitionable", False)
  from pflax import simulate  # pylint: disable=import-outside-toplevel
  config = simulate.ExperimentConfig(rounds=rounds, clients=clients)
  setups = {s: simulate.prepare(config, s) for s in seeds}
  start = time.perf_counter()
  if mode == "sequential":
    runs = [simulate.run(algorithm, config, s, setup=setups[s]) for s in seeds]
    loop = sum(r["seconds"] for r in runs)
  else:
    runs = simulate.sweep(algorithm, config, seeds, setups=setups)
    loop = runs[0]["seconds"]
  total = time.perf_counter() - start
  accuracy = statistics.mean(r["personalized_accuracy"]["final"] for r in runs)
  return {"total": total, "loop": loop, "accuracy": accuracy}


def _spawn(algorithm: str, mode: str, args: argparse.Namespace) -> dict[str, float]:
  command = [sys.executable, __file__, "--worker", algorithm, mode, "--rounds",
             str(args.rounds), "--clients", str(args.clients), "--seeds",
             *map(str, args.seeds)]
  out = subprocess.run(command, capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--algorithms", nargs="+", default=["fedavg", "cwfedavg", "feddwa"])
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  p.add_argument("--rounds", type=int, default=40)
  p.add_argument("--clients", type=int, default=20)
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--out", default=None, help="also write the table to this file")
  p.add_argument("--quick", action="store_true", help="2 rounds, 6 clients, 1 repeat")
  p.add_argument("--worker", nargs=2, metavar=("ALGORITHM", "MODE"), help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.worker:
    print(json.dumps(worker(*args.worker, args.seeds, args.rounds, args.clients)))
    return
  if args.quick:
    args.rounds, args.clients, args.repeats = 2, 6, 1
  results = {(a, m): [] for a in args.algorithms for m in MODES}
  for _ in range(args.repeats):
    for algorithm in args.algorithms:
      for mode in MODES:
        results[algorithm, mode].append(_spawn(algorithm, mode, args))
  med = lambda algorithm, mode, key: statistics.median(
      r[key] for r in results[algorithm, mode])
  lines = [f"S = {len(args.seeds)} seeds, {args.clients} clients, {args.rounds} rounds, "
           f"digits, defaults; medians of {args.repeats} processes per mode.", "",
           "| algorithm | sequential total s | vmapped total s | speed-up total | "
           "sequential loop s | vmapped loop s | speed-up loop | accuracy seq / vmap |",
           "|---|---|---|---|---|---|---|---|"]
  for a in args.algorithms:
    st, vt = med(a, "sequential", "total"), med(a, "vmapped", "total")
    sl, vl = med(a, "sequential", "loop"), med(a, "vmapped", "loop")
    acc = f"{med(a, 'sequential', 'accuracy'):.4f} / {med(a, 'vmapped', 'accuracy'):.4f}"
    lines.append(f"| {a} | {st:.1f} | {vt:.1f} | {st / vt:.2f}x | {sl:.1f} | {vl:.1f} | "
                 f"{sl / vl:.2f}x | {acc} |")
  table = "\n".join(lines)
  print(table)
  if args.out:
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
  main()
