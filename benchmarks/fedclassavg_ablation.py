"""FedClassAvg's Table 4 ablation on a CPU-sized Fashion-MNIST federation.

20 clients, Dir(0.5), a subsample of the training and test splits, pflax's
heterogeneous family, the paper's Fashion-MNIST hyperparameters (Adam lr 6e-4,
betas (0.5, 0.999), B = 64, rho = 0.4662, one local epoch). Prints one JSON
line per run: personalized and global accuracy (best / final) and wall time.
`--augment simclr` replaces the two translations by the authors' SimCLR-style
views (random resized crop, flip, brightness/contrast jitter) for this run only.

  python benchmarks/fedclassavg_ablation.py --train 6000 --rounds 15
"""

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from pflax import data
from pflax import simulate
from pflax._src import builders

RHO = 0.4662
COLUMNS = {"local": None,
           "CA": {"rho": 0.0, "supcon": False},
           "CA+PR": {"rho": RHO, "supcon": False},
           "CA+CL": {"rho": 0.0, "supcon": True},
           "CA+PR+CL": {"rho": RHO, "supcon": True}}


def simclr_view(key, x):
  """The authors' view for 28x28 grayscale: RandomResizedCrop(scale (0.2, 1)),
  horizontal flip, brightness and contrast jitter 0.4 with p = 0.8."""
  b, h, w, c = x.shape
  ks = jax.random.split(key, 6)
  area = jax.random.uniform(ks[0], (b,), minval=0.2, maxval=1.0)
  ratio = jnp.exp(jax.random.uniform(ks[1], (b,), minval=jnp.log(3 / 4),
                                     maxval=jnp.log(4 / 3)))
  ch = jnp.clip(jnp.sqrt(area * ratio) * h, 1.0, h)
  cw = jnp.clip(jnp.sqrt(area / ratio) * w, 1.0, w)
  top = jax.random.uniform(ks[2], (b,)) * (h - ch)
  left = jax.random.uniform(ks[2 + 1], (b,)) * (w - cw)

  def crop(img, t, l, hh, ww):
    scale = jnp.array([h / hh, w / ww])
    return jax.image.scale_and_translate(img, (h, w, c), (0, 1), scale,
                                         -jnp.array([t, l]) * scale, "linear")
  out = jax.vmap(crop)(x, top, left, ch, cw)
  flip = jax.random.bernoulli(ks[4], 0.5, (b, 1, 1, 1))
  out = jnp.where(flip, out[:, :, ::-1], out)
  kb, kc, kp = jax.random.split(ks[5], 3)
  apply = jax.random.bernoulli(kp, 0.8, (b, 1, 1, 1))
  bright = jax.random.uniform(kb, (b, 1, 1, 1), minval=0.6, maxval=1.4)
  contrast = jax.random.uniform(kc, (b, 1, 1, 1), minval=0.6, maxval=1.4)
  mean = jnp.mean(out * bright, axis=(1, 2, 3), keepdims=True)
  jittered = jnp.clip((out * bright - mean) * contrast + mean, 0.0, 1.0)
  return jnp.where(apply, jittered, out)


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
  p.add_argument("--augment", default="translate")
  p.add_argument("--columns", default=",".join(COLUMNS))
  args = p.parse_args()
  if args.augment == "simclr":
    builders.augment_lib.translate = simclr_view
  dataset = subsample(args.train, args.test, args.seed)
  for column in args.columns.split(","):
    name = "local" if COLUMNS[column] is None else "fedclassavg"
    config = simulate.ExperimentConfig(
        dataset="fashion_mnist", partition="dirichlet", dirichlet_alpha=0.5,
        clients=20, rounds=args.rounds, local_epochs=1, batch_size=64,
        heterogeneous=args.model == "hetero",
        model="cnn" if args.model == "hetero" else args.model,
        optimizer="adam", lr=6e-4, adam_b1=0.5,
        optimizers={"fedclassavg": {"optimizer": "adam", "lr": 6e-4, "adam_b1": 0.5}},
        hyperparameters={"fedclassavg": dict(COLUMNS[column] or {},
                                             warmup_epochs=0)})
    start = time.time()
    run = simulate.run(name, config, args.seed, dataset=dataset)
    row = {"column": column, "augment": args.augment, "model": args.model,
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
