"""Sweep speed: S seeds as one sweep against S sequential runs.

Each (algorithm, mode) runs in its own process, modes interleaved over
`--repeats` so that load on a shared machine hits every mode alike:

  sequential  `pflax.simulate.run` once per seed with the default strategy (on
              CPU the threaded loop of jitted per-client programs), compiled
              programs reused across seeds of equal shapes;
  sweep       `pflax.simulate.sweep` over the S seeds with the default
              strategy (on CPU: the S x M clients of all runs in the threaded
              loop, the rest of the round vmapped over runs);
  sweep vmap  `pflax.simulate.sweep` with strategy "vmap": every round of all
              runs as one program (the path for accelerators).

Reported per mode (medians over processes): the end-to-end time of the S runs
including compilation, the round-loop time alone (its first round compiles),
the median time of a round of all S runs after the first, and the speed-ups
sequential / mode (> 1: the mode is faster). The data are prepared before
timing in every mode.

Usage:
  python benchmarks/sweeps.py                           # fedavg cwfedavg feddwa, 3 seeds
  python benchmarks/sweeps.py --algorithms fedavg --rounds 20 --repeats 3
  python benchmarks/sweeps.py --quick                   # smoke run
"""

import argparse
import dataclasses
import json
import pathlib
import statistics
import subprocess
import sys
import time

MODES = ("sequential", "sweep", "sweep vmap")


def worker(algorithm: str, mode: str, seeds: list[int], rounds: int,
           clients: int) -> dict[str, float]:
  from pflax import simulate  # pylint: disable=import-outside-toplevel
  config = simulate.ExperimentConfig(rounds=rounds, clients=clients)
  setups = {s: simulate.prepare(config, s) for s in seeds}
  ends = []
  tick = lambda *_: ends.append(time.perf_counter())
  start = time.perf_counter()
  if mode == "sequential":
    runs = []
    for s in seeds:
      runs.append(simulate.run(algorithm, config, s, setup=setups[s], on_round=tick))
    loop = sum(r.seconds for r in runs)
    per_round = [sum(ends[r + k * rounds] - ends[r + k * rounds - 1]
                     for k in range(len(seeds))) for r in range(1, rounds)]
  else:
    if mode == "sweep vmap":
      config = dataclasses.replace(config, strategy="vmap")
    runs = simulate.sweep(algorithm, config, seeds, setups=setups, on_round=tick)
    loop = runs[0].seconds
    per_round = [b - a for a, b in zip(ends, ends[1:])]
  total = time.perf_counter() - start
  accuracy = statistics.mean(r.summary().final for r in runs)
  return {"total": total, "loop": loop, "round": statistics.median(per_round),
          "accuracy": accuracy}


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
           f"digits, defaults; medians of {args.repeats} processes per mode; speed-up = "
           "sequential / mode.", "",
           "| algorithm | mode | total s | round loop s | s per round of all seeds "
           "| speed-up total | speed-up per round | accuracy |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
  for a in args.algorithms:
    for mode in MODES:
      total, loop, per_round = (med(a, mode, k) for k in ("total", "loop", "round"))
      speed = (f"{med(a, 'sequential', 'total') / total:.2f}x | "
               f"{med(a, 'sequential', 'round') / per_round:.2f}x")
      lines.append(f"| {a} | {mode} | {total:.1f} | {loop:.1f} | {per_round:.3f} | "
                   f"{speed} | {med(a, mode, 'accuracy'):.4f} |")
  table = "\n".join(lines)
  print(table)
  if args.out:
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
  main()
