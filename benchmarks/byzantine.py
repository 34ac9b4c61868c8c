"""Byzantine robustness, measured: each robust rule against each attack (issue 32).

Digits (1,797 8x8 images), 20 clients, Dirichlet 0.3, full participation,
FedAvg's MLP. 20% of each round's participants (4 of 20) are Byzantine, drawn
afresh each round from the run's fault key, and collude as their attack says;
the outlier rule is off, so the rule alone faces the attack. Krum, Multi-Krum
and Bulyan are told f = 4 (Bulyan needs n >= 4f + 3 = 19), the trimmed mean
drops 20% at each end, centered clipping clips at radius 1. The seeds of a cell
run side by side (`pflax.simulate.sweep`).

Prints one JSON line per cell and writes a Markdown table (`--out`): the final
global accuracy (mean of the last 5 evaluations, mean over the seeds) and its
change from the same rule's fault-free run.

  python benchmarks/byzantine.py --rounds 20 --seeds 0 1
"""

import argparse
import dataclasses
import json
import os
import time

import numpy as np

from pflax import simulate

RULES = ("none", "median", "trimmed_mean", "krum", "multi_krum", "bulyan",
         "geometric_median", "centered_clipping")
ATTACKS = ("none", "sign_flip", "gaussian", "alie", "ipm")
BYZANTINE = 0.2
SETTING = dict(clients=20, partition="dirichlet", dirichlet_alpha=0.3, model="mlp",
               outlier_factor=0.0)


def cell_config(base: simulate.ExperimentConfig, rule: str,
                attack: str) -> simulate.ExperimentConfig:
  """The experiment of one rule against one attack ("none": no Byzantine client)."""
  keywords = {"robust": rule, "num_byzantine": round(BYZANTINE * base.clients),
              "trim_fraction": BYZANTINE, "radius": 1.0}
  faults = ({"faulty_clients": 0.0} if attack == "none"
            else {"faulty_clients": BYZANTINE, "fault_kind": attack})
  return dataclasses.replace(base, hyperparameters={"fedavg": keywords}, **faults)


def final_global(config: simulate.ExperimentConfig, seeds: list[int]) -> list[float]:
  """Each seed's final global accuracy."""
  return [run.summary("global").final for run in simulate.sweep("fedavg", config, seeds)]


def table(final: dict[tuple[str, str], float], rounds: int, seeds: list[int],
          seconds: float) -> str:
  """The Markdown report."""
  lines = [
      "# Byzantine robustness: rule x attack", "",
      f"`python benchmarks/byzantine.py --rounds {rounds} --seeds "
      f"{' '.join(map(str, seeds))}` ({seconds:.0f} s on the 2-core CPU). Digits, "
      "20 clients, Dirichlet 0.3, full participation, FedAvg's MLP, "
      f"{rounds} rounds; 4 of the 20 participants Byzantine each round (20%, "
      "colluding), the outlier rule off; f = 4 for Krum, Multi-Krum and Bulyan, "
      "trim fraction 0.2, centered clipping radius 1. Final global accuracy "
      "(mean of the last 5 evaluations, mean over the seeds) and, in brackets, its "
      "change in points from the same rule without Byzantine clients.", "",
      "| rule | " + " | ".join(ATTACKS) + " |",
      "|---|" + "---:|" * len(ATTACKS)]
  for rule in RULES:
    clean = final[rule, "none"]
    cells = [f"{100 * clean:.1f}"] + [
        f"{100 * final[rule, a]:.1f} ({100 * (final[rule, a] - clean):+.1f})"
        for a in ATTACKS[1:]]
    lines.append(f"| {rule} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=20)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__),
                                                    "results", "byzantine.md"))
  args = parser.parse_args()
  base = simulate.ExperimentConfig(rounds=args.rounds, **SETTING)
  started = time.perf_counter()
  final = {}
  for rule in RULES:
    for attack in ATTACKS:
      accuracies = final_global(cell_config(base, rule, attack), args.seeds)
      final[rule, attack] = float(np.mean(accuracies))
      print(json.dumps({"rule": rule, "attack": attack, "seeds": args.seeds,
                        "final": accuracies}), flush=True)
  report = table(final, args.rounds, args.seeds, time.perf_counter() - started)
  with open(args.out, "w", encoding="utf-8") as f:
    f.write(report)
  print(report)


if __name__ == "__main__":
  main()
