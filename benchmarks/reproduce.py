# SPDX-License-Identifier: Apache-2.0
"""Reproduction table: the eight algorithms on digits, two partitions, several seeds.

Runs every algorithm on the offline digits dataset (20 clients, pathological 2
classes per client and Dirichlet alpha = 0.1), its seeds as one
`pflax.simulate.sweep` (each run equals `pflax.simulate.run` with its seed up
to float rounding), and writes to `--out` (default `benchmarks/results/`):

- `reproduction.md`: personalized accuracy (best and final), global accuracy
  where the method has a global model and FedDWA's exclusive models' accuracy,
  mean ± std over seeds;
- `reproduction-<partition>.json`: the run records in `pflax-run`'s
  `results.json` format (without the output-layer norms);
- `reproduction.png`: mean personalized accuracy per round, one panel per
  partition, a band of ± one std over seeds.

    python benchmarks/reproduce.py                  # 40 rounds, seeds 0 1 2 (minutes)
    python benchmarks/reproduce.py --quick          # 2 rounds, seed 0: a smoke run
    python benchmarks/reproduce.py --algorithms fedavg cwfedavg --seeds 0
    python benchmarks/reproduce.py --replot         # table and plot from the JSON
"""

import argparse
import dataclasses
import inspect
import json
import os
import platform
import sys
import time
from typing import Any

import jax
import numpy as np

from pflax import algorithms
from pflax import simulate
from pflax._src.simulation.records import FINAL_WINDOW
import pflax

ALGORITHMS = ("local", "fedavg", "fedprox", "cwfedavg", "fedclassavg", "fedsa",
              "feddwa", "fedrema")
PARTITIONS = {"pathological": "pathological, 2 classes per client",
              "dirichlet": "Dirichlet, alpha = 0.1"}
HERE = os.path.dirname(os.path.abspath(__file__))


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--quick", action="store_true",
                 help="smoke run: 2 rounds and seed 0 unless given")
  p.add_argument("--rounds", type=int, default=None, help="default 40 (2 with --quick)")
  p.add_argument("--seeds", type=int, nargs="+", default=None,
                 help="default 0 1 2 (0 with --quick)")
  p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS),
                 choices=ALGORITHMS, metavar="NAME")
  p.add_argument("--partitions", nargs="+", default=list(PARTITIONS),
                 choices=list(PARTITIONS), metavar="NAME")
  p.add_argument("--replot", action="store_true",
                 help="only rewrite the table and plot from the JSON files in --out")
  p.add_argument("--out", default=None,
                 help="default benchmarks/results (runs/reproduce-quick with --quick)")
  return p


def mean_std(values: list[float]) -> str:
  """`mean ± std` in percent; std over seeds (ddof 0, as in `pflax-run`)."""
  return f"{100 * np.mean(values):.2f} ± {100 * np.std(values):.2f}"


def run_sweeps(label: str, config: simulate.ExperimentConfig, names: list[str],
               seeds: list[int]) -> tuple[simulate.Results, float]:
  """Every algorithm on one configuration, its seeds as one sweep: results and
  seconds (`label` names the configuration in the progress lines)."""
  started = time.perf_counter()
  setups = {seed: simulate.prepare(config, seed) for seed in seeds}
  runs = []
  for name in names:
    for run in simulate.sweep(name, config, seeds, setups=setups):
      runs.append(dataclasses.replace(run, output_norms=np.zeros((0,))))
      acc = run.summary()
      print(f"{label:12s} {name:12s} seed {run.seed}: personalized best "
            f"{acc.best:.4f} final {acc.final:.4f} ({run.seconds:.1f} s "
            "for the sweep)", flush=True)
  record = dataclasses.asdict(config)
  record.update(algorithms=list(names), seeds=list(seeds))
  results = simulate.Results(record, setups[seeds[0]].federation.counts, tuple(runs))
  return results, time.perf_counter() - started


def _rows(results: simulate.Results) -> list[str]:
  lines = []
  for name in dict.fromkeys(r.label for r in results.runs):
    runs = [r for r in results.runs if r.label == name]
    cells = [mean_std([getattr(r.summary(), k) for r in runs])
             for k in ("best", "final")]
    for kind, keys in (("global", ("best", "final")), ("exclusive", ("final",))):
      cells += [mean_std([getattr(r.summary(kind), k) for r in runs])
                if runs[0].summary(kind) else "—" for k in keys]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  return lines


def _method_hyperparameters(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
  """Each builder's keyword defaults, overridden by the configuration's."""
  out = {}
  for name, builder in ((n, m.builder) for n, m in algorithms.METHODS.items()):
    params = inspect.signature(builder).parameters.values()
    out[name] = {p.name: p.default for p in params if p.kind == p.KEYWORD_ONLY}
    out[name].update(config.get("hyperparameters", {}).get(name, {}))
  return out


def markdown(all_results: dict[str, simulate.Results], seconds: float) -> str:
  """The reproduction tables with a header describing the configuration."""
  c = next(iter(all_results.values())).config
  hp = c.get("hp", c)   # files written before issue 12 nest the training base
  own = {**c.get("optimizers", {}).get("fedclassavg", {})}
  own.setdefault("lr", hp.get("fedclassavg_lr"))
  own.setdefault("adam_b1", hp.get("fedclassavg_adam_b1"))
  m = _method_hyperparameters(c)
  seeds = " ".join(map(str, c["seeds"]))
  lines = [
      "# Reproduction on digits",
      "",
      "Regenerate with `python benchmarks/reproduce.py` "
      f"(`--rounds {c['rounds']} --seeds {seeds}`).",
      "",
      f"Configuration: scikit-learn's digits (1,797 8x8 images, 10 classes), "
      f"{c['clients']} clients, all taking part every round, a 75/25 train/test split "
      f"per client, {c['rounds']} rounds, the MLP model (`--model auto`), "
      f"{hp['optimizer'].upper()} lr {hp['lr']}, batch {hp['batch_size']}, "
      f"{hp['local_epochs']} local epochs for every algorithm except FedClassAvg "
      f"(Adam lr {own['lr']}, betas ({own['adam_b1']}, 0.999), "
      f"plus {m['fedclassavg']['warmup_epochs']} warm-up epoch). Method "
      f"hyperparameters: FedProx mu {m['fedprox']['mu']}; cwFedAvg on the output layer, "
      f"WDR coefficient {m['cwfedavg']['wdr_coef']} (the paper's lambda "
      f"{2 * m['cwfedavg']['wdr_coef']:g}); FedClassAvg rho {m['fedclassavg']['rho']}, "
      f"SupCon temperature {m['fedclassavg']['supcon_temperature']:g}; FedSA tau "
      f"{m['fedsa']['cv_threshold']}, {m['fedsa']['num_mic']} MIC bins, "
      f"{m['fedsa']['num_mac']} MAC clusters; FedDWA alpha {m['feddwa']['alpha']}, "
      f"lambda {m['feddwa']['lam']}; FedReMa delta {m['fedrema']['delta']} "
      "(the builders' defaults, the same as `pflax-run`).",
      "",
      "Accuracies in percent, mean ± std over the seeds (population std). "
      "Personalized: sample-weighted accuracy of each client's own model on its own "
      "test split; best over rounds, and final = mean of the last "
      f"{FINAL_WINDOW} rounds. Global: the global model on all clients' "
      "test splits (FedAvg, FedProx, FedSA; FedClassAvg's averaged classifier on "
      "each client's own features), `—` where the method has none. Exclusive: "
      "FedDWA's exclusive models, one per client. The seed sets the partition, "
      "the split, the initialisation and the shuffles.",
  ]
  for partition, results in all_results.items():
    lines += ["", f"## {PARTITIONS[partition]}", "",
              "| algorithm | personalized best | personalized final | global best "
              "| global final | exclusive final |",
              "|---|---:|---:|---:|---:|---:|"]
    lines += _rows(results)
  lines += ["", f"Ran in {seconds / 60:.1f} min on {platform.machine()} "
            f"({os.cpu_count()} cores), jax {jax.__version__}, pflax "
            f"{pflax.__version__}.", ""]
  return "\n".join(lines)


def plot(all_results: dict[str, simulate.Results], path: str,
         titles: dict[str, str], columns: int = 2) -> None:
  """Mean personalized accuracy per round and algorithm, ± one std band: one panel
  per results, titled `titles[key]`, `columns` panels a row."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  cols = min(columns, len(all_results))
  rows = -(-len(all_results) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.2 * rows),
                           squeeze=False, sharey=True)
  for ax in axes.flat[len(all_results):]:
    ax.set_visible(False)
  for ax, (key, results) in zip(axes.flat, all_results.items()):
    for name in dict.fromkeys(r.label for r in results.runs):
      runs = [r for r in results.runs if r.label == name]
      rounds = runs[0].curve()[0]
      curves = np.array([r.curve()[1] for r in runs])
      mean, std = 100 * curves.mean(0), 100 * curves.std(0)
      color = simulate.algorithm_color(runs[0].algorithm)
      ax.plot(rounds, mean, label=name, color=color)
      ax.fill_between(rounds, mean - std, mean + std, alpha=0.15, color=color)
    ax.set_title(titles[key], fontsize=10)
    ax.set_xlabel("round")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
  for ax in axes[:, 0]:
    ax.set_ylabel("personalized accuracy (%)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  rounds = args.rounds or (2 if args.quick else 40)
  seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
  out = args.out or (os.path.join("runs", "reproduce-quick") if args.quick
                     else os.path.join(HERE, "results"))
  os.makedirs(out, exist_ok=True)
  all_results, seconds = {}, 0.0
  for partition in args.partitions:
    path = os.path.join(out, f"reproduction-{partition}.json")
    if args.replot:
      with open(path) as f:
        saved = json.load(f)
      all_results[partition] = simulate.Results.from_json(saved)
      seconds += saved.get("seconds", 0.0)
      continue
    config = simulate.ExperimentConfig(partition=partition, clients=20,
                                       classes_per_client=2, dirichlet_alpha=0.1,
                                       rounds=rounds)
    all_results[partition], spent = run_sweeps(partition, config, args.algorithms,
                                               seeds)
    seconds += spent
    with open(path, "w") as f:
      json.dump({**all_results[partition].to_json(), "seconds": spent}, f, indent=1)
  text = markdown(all_results, seconds)
  with open(os.path.join(out, "reproduction.md"), "w") as f:
    f.write(text)
  plot(all_results, os.path.join(out, "reproduction.png"),
       {k: f"digits, {PARTITIONS[k]}" for k in all_results})
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
