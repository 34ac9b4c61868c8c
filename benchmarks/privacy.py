"""Accuracy against the privacy budget eps (delta = 1e-5) on Fashion-MNIST.

`python benchmarks/privacy.py` writes benchmarks/results/privacy.md: for each
method and eps in {1, 2, 4, 8, inf}, the noise multiplier z calibrated to eps
after the planned rounds (`pflax.privacy.noise_multiplier_for`, RDP
accountant), the sampling rate q, the rounds and the final personalized
accuracy. Reduced to fit a loaded 2-core CPU (see REDUCTIONS).
"""

import math
import os
import re
import sys
import time

from pflax import privacy
from pflax import simulate

METHODS = ("fedavg", "fedper", "ditto", "fedrep", "cwfedavg", "fedclassavg")
EPSILONS = (1.0, 2.0, 4.0, 8.0, math.inf)
DELTA = 1e-5
CLIP = 1.0
REDUCTIONS = dict(dataset="fashion_mnist", model="mlp", partition="dirichlet",
                  dirichlet_alpha=0.3, clients=20, samples_per_client=100,
                  participation=0.5, rounds=8, local_epochs=1, batch_size=20,
                  eval_every=8, test_split="clients")
"""The runs' settings: 20 clients of 100 samples, an MLP, 8 rounds of 1 epoch."""
HYPERPARAMETERS = {"fedclassavg": {"warmup_epochs": 0}}
"""The methods' defaults otherwise; FedClassAvg without its warm-up epoch, as in
pflax's presets (every method gets the same 8 epochs)."""


def config(epsilon: float) -> tuple[simulate.ExperimentConfig, float]:
  """The experiment at budget `epsilon` (inf: no DP) and its z."""
  if math.isinf(epsilon):
    return simulate.ExperimentConfig(**REDUCTIONS,
                                     hyperparameters=HYPERPARAMETERS), 0.0
  z = privacy.noise_multiplier_for(epsilon, DELTA, REDUCTIONS["participation"],
                                   REDUCTIONS["rounds"])
  return simulate.ExperimentConfig(**REDUCTIONS, hyperparameters=HYPERPARAMETERS,
                                   dp_clip=CLIP, dp_noise_multiplier=z,
                                   dp_epsilon=epsilon, dp_delta=DELTA), z


def final(name: str, cfg: simulate.ExperimentConfig) -> str:
  """The run's final personalized accuracy (%), or the round at which every
  participant diverged (the engine stops a run whose uploads are all dropped)."""
  try:
    return f"{100 * simulate.run(name, cfg, 0).summary().final:.2f}"
  except ValueError as e:
    if "every participant was dropped" not in str(e):
      raise
    return "diverged (round " + re.search(r"round (\d+)", str(e)).group(1) + ")"


def main() -> None:
  lines = ["| method | eps | z | q | rounds | personalized final (%) |",
           "|---|---|---|---|---|---|"]
  started = time.perf_counter()
  for epsilon in EPSILONS:
    cfg, z = config(epsilon)
    for name in METHODS:
      lines.append(f"| {name} | {epsilon:g} | {z:.3f} | {cfg.participation:g} | "
                   f"{cfg.rounds} | {final(name, cfg)} |")
      print(lines[-1], flush=True)
  note = (f"\nFashion-MNIST, {REDUCTIONS}, hyperparameters {HYPERPARAMETERS}, "
          f"clip C = {CLIP}, delta = {DELTA:g}, seed 0; "
          f"eps inf: no DP (fixed-count sampling, sample-weighted). "
          f"{time.perf_counter() - started:.0f} s in all.\n")
  out = os.path.join(os.path.dirname(__file__), "results", "privacy.md")
  with open(out, "w", encoding="utf-8") as f:
    f.write("# Accuracy against the privacy budget\n\n`python benchmarks/privacy.py`\n\n"
            + "\n".join(lines) + "\n" + note)
  print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
  main()
