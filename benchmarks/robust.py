"""Dishonest clients, measured: FedAvg with and without the outlier rule and
the robust options (issue 22, item 4).

Digits, 10 clients, Dirichlet 0.5, full participation. One faulty client
(`faulty_clients=0.1`): "scaled" multiplies its update by 1e30 each round
(a fresh draw each round); "inflated_counts" declares its class counts x10 at
registration (the same client all run). Prints one JSON line per row and a
Markdown table (benchmarks/results/robust.md).

  python benchmarks/robust.py --rounds 10 --seeds 0 1 2
"""

import argparse
import dataclasses
import json

import numpy as np

from pflax import aggregate
from pflax import simulate
from pflax._src.simulation import faults as faults_lib

ROWS = {
    "no faults": ({}, {}),
    "scaled 1e30, outlier rule off": ({"fault_kind": "scaled", "outlier_factor": 0.0},
                                      {}),
    "scaled 1e30, outlier rule (1000)": ({"fault_kind": "scaled"}, {}),
    "scaled 1e30, rule off, median": ({"fault_kind": "scaled", "outlier_factor": 0.0},
                                      {"robust": "median"}),
    "scaled 1e30, rule off, clip_norm 10": (
        {"fault_kind": "scaled", "outlier_factor": 0.0}, {"clip_norm": 10.0}),
    "inflated counts x10": ({"fault_kind": "inflated_counts"}, {}),
    "inflated counts x10, max_share 0.2": ({"fault_kind": "inflated_counts"},
                                           {"max_share": 0.2}),
}


def liar_share(config: simulate.ExperimentConfig, setup: simulate.Setup, seed: int,
               max_share: float | None, factor: float) -> float:
  """The lying client's FedAvg weight, from the counts the server sees."""
  counts = np.asarray(setup.federation.counts, np.float64).sum(axis=1)
  m = counts.shape[0]
  liars = np.asarray(faults_lib.lying_clients(seed, config.clients, m,
                                          config.faulty_clients))
  seen = np.where(liars, counts * factor, counts)
  weights = (seen / seen.sum() if max_share is None
             else np.asarray(aggregate.capped_weights(seen, max_share)))
  return float(weights[liars].sum())


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--rounds", type=int, default=10)
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  args = p.parse_args()
  base = simulate.ExperimentConfig(clients=10, partition="dirichlet",
                                   dirichlet_alpha=0.5, rounds=args.rounds,
                                   model="mlp", faulty_clients=0.1)
  setups = {seed: simulate.prepare(base, seed) for seed in args.seeds}
  lines = [f"Digits, 10 clients, Dirichlet 0.5, {args.rounds} rounds, FedAvg (MLP), "
           f"seeds {args.seeds}: the mean over seeds of the global accuracy (final: "
           "mean of the last 5 evaluations), the lying client's FedAvg weight "
           "(its true weight in brackets), and the rounds in which the server dropped "
           "anyone.", "",
           "| case | global accuracy (final) | best | liar's weight | "
           "rounds with dropped clients |", "|---|---|---|---|---|"]
  for name, (fields, keywords) in ROWS.items():
    config = dataclasses.replace(base, **fields,
                                 hyperparameters={"fedavg": keywords})
    if name == "no faults":
      config = dataclasses.replace(config, faulty_clients=0.0)
    rows = []
    for seed in args.seeds:
      run = simulate.run("fedavg", config, seed, setup=setups[seed])
      summary = run.summary("global")
      dropped = [list(r.dropped_clients) for r in run.history]
      faulty = [list(r.faulty_clients) for r in run.history]
      lies = config.fault_kind == "inflated_counts"
      share = liar_share(config, setups[seed], seed, keywords.get("max_share"), 10.0)
      true = liar_share(config, setups[seed], seed, None, 1.0)
      row = {"case": name, "seed": seed, "final": summary.final, "best": summary.best,
             "liar_share": share if lies else None, "true_share": true if lies else None,
             "dropped": dropped, "faulty": faulty}
      print(json.dumps(row), flush=True)
      rows.append(row)
    mean = lambda key: np.mean([r[key] for r in rows])
    rounds = sum(sum(bool(d) for d in r["dropped"]) for r in rows)
    share = (f"{100 * mean('liar_share'):.1f}% ({100 * mean('true_share'):.1f}%)"
             if rows[0]["liar_share"] is not None else "")
    lines.append(f"| {name} | {100 * mean('final'):.1f}% | {100 * mean('best'):.1f}% | "
                 f"{share} | {rounds} of {len(rows) * args.rounds} |")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
