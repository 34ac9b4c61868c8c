# SPDX-License-Identifier: Apache-2.0
"""Reproduction table on Fashion-MNIST: every `fmnist` preset next to its paper.

Runs each Fashion-MNIST preset of `pflax-run --list-presets` (its algorithms,
its seeds as one `pflax.simulate.sweep` each, as `benchmarks/reproduce.py`
does for digits) and writes to `--out` (default `benchmarks/results/`):

- `reproduction_fmnist.md` (`--size cpu`) or `reproduction_fmnist_paper.md`
  (`--size paper`): per preset and algorithm, personalized accuracy (best and
  final, mean ± std over seeds) next to the paper's number, the gap, the wall
  time and the device; presets without results are listed as not run;
- `reproduction_fmnist[_paper]/<preset>.json`: the run records in
  `pflax-run`'s `results.json` format (without the output-layer norms), with
  the wall time and the device;
- `reproduction_fmnist[_paper].png`: mean personalized accuracy per round.

Sizes: `paper` runs the presets as they are (a GPU's work); `cpu` applies
`CPU`'s reductions (the same to every algorithm of a preset) so that every
preset runs in under an hour on 2 CPU cores.

    python benchmarks/reproduce_fmnist.py                   # --size cpu
    python benchmarks/reproduce_fmnist.py --size paper      # GPU
    python benchmarks/reproduce_fmnist.py --quick           # 2 rounds, seed 0, tiny
    python benchmarks/reproduce_fmnist.py --presets fedrema-fmnist-groups
    python benchmarks/reproduce_fmnist.py --replot          # table from the JSON
"""

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

import jax
import numpy as np

from pflax import simulate
from pflax._src.cli import presets
import pflax

from reproduce import HERE, mean_std, plot, run_sweeps

PRESETS = tuple(n for n in presets.names() if "-fmnist-" in n)

_HETEROGENEOUS_CPU = dict(family="mlp", samples_per_client=500, rounds=40)
CPU: dict[str, tuple[dict[str, Any], tuple[int, ...]]] = {
    "feddwa-fmnist-pathological": (
        dict(model="mlp", samples_per_client=300, rounds=30), (0, 1)),
    "feddwa-fmnist-pathological-100-clients": (
        dict(model="mlp", samples_per_client=300, rounds=50), (0, 1)),
    "fedrema-fmnist-groups": (dict(model="mlp", rounds=30), (0, 1, 2)),
    "fedclassavg-fmnist-dirichlet": (
        dict(model="mlp", samples_per_client=300, rounds=30), (0, 1)),
    "fedclassavg-fmnist-dirichlet-100-clients": (
        dict(model="mlp", samples_per_client=300, rounds=50), (0, 1)),
    **{name: (dict(model="mlp", samples_per_client=300, rounds=50), (0,))
       for name in PRESETS if name.startswith("pfllib-")},
    **{name: (_HETEROGENEOUS_CPU, (0, 1)) for name in PRESETS
       if presets.get(name).config.get("heterogeneous")},
}
"""`--size cpu`: per preset, `ExperimentConfig` fields replacing the preset's, and
the seeds. The MLP replaces the CNN where the preset is not heterogeneous, the
MLP family (`family="mlp"`) the convolutional family where it is."""

QUICK = dict(rounds=2, samples_per_client=60)
"""`--quick`, on top of the size: a smoke run (seed 0)."""


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--size", choices=("cpu", "paper"), default="cpu",
                 help="cpu: CPU's reductions (default); paper: the presets as they are")
  p.add_argument("--quick", action="store_true",
                 help="smoke run: 2 rounds, seed 0, 60 samples per client")
  p.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS,
                 metavar="NAME")
  p.add_argument("--seeds", type=int, nargs="+", default=None,
                 help="override every preset's seeds")
  p.add_argument("--algorithms", nargs="+", default=None, metavar="NAME",
                 help="run only these of each preset's algorithms, keeping the "
                      "others' saved runs")
  p.add_argument("--replot", action="store_true",
                 help="only rewrite the table and plot from the JSON files in --out")
  p.add_argument("--out", default=None,
                 help="default benchmarks/results (runs/reproduce-fmnist-quick with "
                      "--quick)")
  return p


def setting(name: str, size: str, quick: bool = False
            ) -> tuple[simulate.ExperimentConfig, tuple[int, ...]]:
  """The configuration and seeds of preset `name` at `size` (and `--quick`)."""
  preset = presets.get(name)
  fields, seeds = dict(preset.config), preset.seeds
  if size == "cpu":
    changes, seeds = CPU[name]
    fields.update(changes)
  if quick:
    cap = min(fields.get("samples_per_client") or QUICK["samples_per_client"],
              QUICK["samples_per_client"])
    fields.update(QUICK, samples_per_client=cap)
    seeds = seeds[:1]
  return simulate.ExperimentConfig(**fields), seeds


def reductions(name: str, config: dict[str, Any], seeds: list[int]) -> str:
  """What `config` and `seeds` change in preset `name`: `field preset → here`."""
  preset = presets.get(name)
  default = simulate.ExperimentConfig(**preset.config)
  changed = [f"{k} {getattr(default, k) or 'all'} → {v}" for k, v in config.items()
             if hasattr(default, k) and not isinstance(v, (dict, list))
             and v != getattr(default, k)]
  if tuple(seeds) != preset.seeds:
    changed.append(f"seeds {' '.join(map(str, preset.seeds))} → "
                   f"{' '.join(map(str, seeds))}")
  return "; ".join(changed) or "none (the preset as it is)"


def _percent(name: str, number: float) -> float:
  """The paper's number in percent (FedClassAvg's are fractions of 1)."""
  return 100 * number if name.startswith("fedclassavg") else number


def _order(accuracy: dict[str, float]) -> str:
  return " > ".join(sorted(accuracy, key=accuracy.get, reverse=True))


def _section(name: str, saved: dict[str, Any] | None, size: str) -> list[str]:
  preset = presets.get(name)
  lines = ["", f"## {name}", "", preset.description.split(";")[0] + "."]
  if saved is None:
    config, seeds = setting(name, size)
    return lines + ["", "Not run here (time). Its changes: "
                    f"{reductions(name, dataclasses.asdict(config), list(seeds))}."]
  results = simulate.Results.from_json(saved)
  device = saved["device"]
  reduced = reductions(name, saved["config"], saved["config"]["seeds"])
  lines += ["", f"Changed: {reduced}. Ran in {saved['seconds'] / 60:.1f} min on "
            f"{device['kind']} ({device['cores']} cores), jax {device['jax']}.", "",
            "| algorithm | personalized best | personalized final | paper | "
            "gap (best − paper) | wall |",
            "|---|---:|---:|---:|---:|---:|"]
  ours, paper = {}, {}
  for algorithm in preset.algorithms:
    runs = [r for r in results.runs if r.algorithm == algorithm]
    best = [r.summary().best for r in runs]
    paper[algorithm] = _percent(name, preset.paper[algorithm])
    ours[algorithm] = float(np.mean([r.summary().final for r in runs]))
    gap = 100 * np.mean(best) - paper[algorithm]
    lines.append(f"| {algorithm} | {mean_std(best)} | "
                 f"{mean_std([r.summary().final for r in runs])} | "
                 f"{paper[algorithm]:.2f} | {gap:+.2f} | {runs[0].seconds:.0f} s |")
  if len(preset.algorithms) > 1:
    same = "the same" if _order(ours) == _order(paper) else "differs"
    lines += ["", f"Ordering: paper {_order(paper)}; pflax (final) {_order(ours)} "
              f"({same})."]
  return lines


def markdown(saved: dict[str, dict[str, Any] | None], size: str) -> str:
  """The reproduction table: a header, then one section per preset."""
  lines = [
      "# Reproduction on Fashion-MNIST",
      "",
      f"Regenerate with `python benchmarks/reproduce_fmnist.py --size {size}`; "
      "`--replot` rewrites this file from the JSON records in "
      f"`{_stem(size)}/`.",
      "",
      "The real Fashion-MNIST (70,000 28x28 images, `pflax.data.load("
      "\"fashion_mnist\")`), each preset of `pflax-run --list-presets` whose name "
      "contains `fmnist`, with its algorithms, hyperparameters and sources "
      "(`pflax/_src/cli/presets.py`). "
      + ("The presets as they are (`--size paper`)." if size == "paper" else
         "`--size cpu`: each preset reduced to run on 2 CPU cores, the same "
         "reductions for every algorithm of a preset (its `Changed:` line): pflax's "
         "MLP (784-200-200-10) instead of the CNN where the preset is not "
         "heterogeneous, fewer rounds and seeds, and a cap on each client's samples "
         "(`samples_per_client`). The heterogeneous presets train pflax's family "
         "of four MLPs (`family mlp`, `pflax.models.mlp_family`: widths 128, 1024, "
         "256-256 and 128-256-256 before a shared 512-d representation) instead of "
         "its convolutional family, whose 20-client FedClassAvg took 7 minutes for "
         "10 rounds of 100 samples per client here. These are far from the "
         "papers' budgets: compare orderings, not levels."),
      "",
      "Accuracies in percent, mean ± std over the seeds (population std). "
      "Personalized: sample-weighted accuracy of each client's own model on its own "
      "test data; best over rounds, final = mean of the last 5 rounds. Paper: the "
      "number the paper reports for that algorithm (FedClassAvg's fractions of 1 in "
      "percent); gap: pflax's mean best minus it, in points (FedClassAvg's paper "
      "averages the clients' accuracies unweighted: `client_mean` in the JSON "
      "records). Wall: the algorithm's sweep over the seeds, compilation included. "
      f"pflax {pflax.__version__}.",
  ]
  for name, record in saved.items():
    lines += _section(name, record, size)
  return "\n".join(lines + [""])


def _merged(path: str, new: dict[str, Any], order: tuple[str, ...]
            ) -> dict[str, Any]:
  """The saved record at `path` with the runs of `new`'s algorithms replaced by
  `new`'s, in the preset's algorithm order; wall times add up."""
  with open(path) as f:
    old = json.load(f)
  ran = set(new["config"]["algorithms"])
  runs = [r for r in old["runs"] if r["algorithm"] not in ran] + new["runs"]
  runs.sort(key=lambda r: (order.index(r["algorithm"]), r["seed"]))
  config = dict(new["config"], algorithms=[a for a in order
                                           if any(r["algorithm"] == a for r in runs)])
  return {**new, "config": config, "runs": runs,
          "seconds": old["seconds"] + new["seconds"]}


def _stem(size: str) -> str:
  return "reproduction_fmnist" + ("_paper" if size == "paper" else "")


def _device() -> dict[str, Any]:
  return {"kind": jax.devices()[0].device_kind, "jax": jax.__version__,
          "cores": os.cpu_count()}


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  out = args.out or (os.path.join("runs", "reproduce-fmnist-quick") if args.quick
                     else os.path.join(HERE, "results"))
  folder = os.path.join(out, _stem(args.size))
  os.makedirs(folder, exist_ok=True)
  for name in [] if args.replot else args.presets:
    config, seeds = setting(name, args.size, args.quick)
    seeds = args.seeds or list(seeds)
    chosen = [a for a in presets.get(name).algorithms
              if args.algorithms is None or a in args.algorithms]
    if not chosen:
      continue
    results, seconds = run_sweeps(name, config, chosen, seeds)
    path = os.path.join(folder, f"{name}.json")
    record = {**results.to_json(), "seconds": seconds, "device": _device()}
    if args.algorithms is not None and os.path.exists(path):
      record = _merged(path, record, presets.get(name).algorithms)
    with open(path, "w") as f:
      json.dump(record, f, indent=1)
  saved = {}
  for name in PRESETS:
    path = os.path.join(folder, f"{name}.json")
    saved[name] = None
    if os.path.exists(path):
      with open(path) as f:
        saved[name] = json.load(f)
  text = markdown(saved, args.size)
  with open(os.path.join(out, f"{_stem(args.size)}.md"), "w") as f:
    f.write(text)
  ran = {n: simulate.Results.from_json(s) for n, s in saved.items() if s}
  if ran:
    plot(ran, os.path.join(out, f"{_stem(args.size)}.png"), {n: n for n in ran},
         columns=3)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
