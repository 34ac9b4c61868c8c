"""FedClassAvg's Table 4 ablation on a CPU-sized Fashion-MNIST federation.

20 clients, Dir(0.5), a subsample of the training and test splits, pflax's
heterogeneous family, the paper's Fashion-MNIST hyperparameters (Adam lr 6e-4,
betas (0.5, 0.999), B = 64, rho = 0.4662, one local epoch). Prints one JSON
line per run: personalized and global accuracy (best / final) and wall time.
`--augment` sets the views of every column (the builders' `augment=`:
`translate`, `simclr` = the authors' SimCLR views, `none`); a column written
`NAME@AUGMENT` sets its own. Unset, each builder's default: Local `none`,
FedClassAvg `translate`.

  python benchmarks/fedclassavg_ablation.py --train 6000 --rounds 15
  python benchmarks/fedclassavg_ablation.py --model mlp --train 4000 --test 2000 \
    --rounds 40 --columns local,local@simclr,CA+PR+CL,CA+PR+CL@simclr,CA@simclr
"""

import argparse
import dataclasses
import json
import time

import numpy as np

from pflax import data
from pflax import simulate

RHO = 0.4662
COLUMNS = {"local": None,
           "CA": {"rho": 0.0, "supcon": False},
           "CA+PR": {"rho": RHO, "supcon": False},
           "CA+CL": {"rho": 0.0, "supcon": True},
           "CA+PR+CL": {"rho": RHO, "supcon": True}}


def subsample(train, test, seed):
  full = data.load("fashion_mnist")
  rng = np.random.default_rng(seed)
  i = rng.choice(len(full.labels), train, replace=False)
  j = rng.choice(len(full.test_labels), test, replace=False)
  return data.from_arrays(full.images[i], full.labels[i], num_classes=10,
                          name="fashion_mnist", test_images=full.test_images[j],
                          test_labels=full.test_labels[j])


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--train", type=int, default=6000)
  p.add_argument("--test", type=int, default=4000)
  p.add_argument("--rounds", type=int, default=15)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--model", default="hetero")
  p.add_argument("--augment", default=None,
                 help="views of every column (default: each builder's own)")
  p.add_argument("--columns", default=",".join(COLUMNS))
  args = p.parse_args()
  dataset = subsample(args.train, args.test, args.seed)
  for spec in args.columns.split(","):
    column, _, augment = spec.partition("@")
    augment = augment or args.augment
    name = "local" if COLUMNS[column] is None else "fedclassavg"
    keywords = dict(COLUMNS[column] or {})
    if name == "fedclassavg":
      keywords["warmup_epochs"] = 0
    if augment is not None:
      keywords["augment"] = augment
    config = simulate.ExperimentConfig(
        dataset="fashion_mnist", partition="dirichlet", dirichlet_alpha=0.5,
        clients=20, rounds=args.rounds, local_epochs=1, batch_size=64,
        heterogeneous=args.model == "hetero",
        model="cnn" if args.model == "hetero" else args.model,
        optimizer="adam", lr=6e-4, adam_b1=0.5,
        optimizers={"fedclassavg": {"optimizer": "adam", "lr": 6e-4, "adam_b1": 0.5}},
        hyperparameters={name: keywords})
    start = time.time()
    run = simulate.run(name, config, args.seed, dataset=dataset)
    row = {"column": column,
           "augment": augment or ("none" if name == "local" else "translate"),
           "model": args.model,
           "train": args.train, "rounds": args.rounds, "seed": args.seed,
           "wall_s": round(time.time() - start, 1)}
    for kind in ("personalized", "global"):
      summary = run.summary(kind)
      if summary is not None:
        row[kind] = {k: round(float(v), 4) for k, v in
                     dataclasses.asdict(summary).items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool)}
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
  main()
