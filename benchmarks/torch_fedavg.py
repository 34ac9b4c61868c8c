"""The default `pflax-run --algorithms fedavg` job as a PFLlib-style PyTorch script.

A standalone baseline for `startup.py` (it imports numpy, scikit-learn, torch,
matplotlib and json, never pflax or JAX), doing the work of pflax's default
experiment:

  data       scikit-learn's digits (1,797 8x8 images, pixels / 16, 10 classes),
             partitioned pathologically over 20 clients with 2 classes each
             (every class held by 4 clients, its shuffled samples split into
             near-equal parts), then split 75/25 into train and test per client
             and class (`round(0.25 n)` test samples of a class with n); the
             assignment is this script's own (numpy seed), the sizes are those of
             pflax's partition;
  model      pflax's digits MLP: flatten, 64-200-200-10, ReLU after both hidden
             layers (55,210 parameters; torch's default initialisation);
  training   FedAvg, full participation, per round and client: copy the global
             weights into the client's model (PFLlib's `set_parameters`),
             `model.train()`, 5 local epochs, each a fresh `torch.randperm` of
             the client's samples in mini-batches of 10 (the last one smaller),
             `zero_grad`, cross-entropy averaged over the batch, `backward`,
             SGD step (lr 0.05, no momentum); no DataLoader;
  server     the sample-weighted average of the clients' state dicts loaded
             into the global model;
  evaluation every round, `model.eval()` and `torch.no_grad()`, the global
             model (FedAvg's personalized model: every client holds it) on every
             client's test split;
  output     `results.json` (the layout of pflax-run's, one run),
             `accuracy.png` (accuracy per round) and `output_norms.png` (the
             clients' training samples per class beside the l2-norms of each
             client's output-layer weights per class), written with matplotlib.

It prints the run's best and final (mean of the last 5 evaluations) accuracy.

Usage:
  python benchmarks/torch_fedavg.py                      # 40 rounds, into runs/torch_fedavg
  python benchmarks/torch_fedavg.py --rounds 1 --out /tmp/t --threads 1
"""

import argparse
import json
import os
import time

import numpy as np
from sklearn.datasets import load_digits
import torch
from torch import nn

CLIENTS, CLASSES_PER_CLIENT, TEST_FRACTION = 20, 2, 0.25
EPOCHS, BATCH, LR = 5, 10, 0.05
HIDDEN = (200, 200)
FINAL_WINDOW = 5
"""`final` accuracy: the mean of the last this many evaluations (as pflax)."""


def partition(labels: np.ndarray, num_classes: int, rng: np.random.Generator
              ) -> list[np.ndarray]:
  """Pathological partition: each client holds `CLASSES_PER_CLIENT` classes.

  Clients take the classes of random permutations of all classes in pairs, so
  every class is held by `CLIENTS * CLASSES_PER_CLIENT / num_classes` clients;
  each class's shuffled samples are split into near-equal parts among them.
  """
  per_perm = num_classes // CLASSES_PER_CLIENT
  perms = [rng.permutation(num_classes) for _ in range(-(-CLIENTS // per_perm))]
  classes = np.concatenate(perms).reshape(-1, CLASSES_PER_CLIENT)[:CLIENTS]
  parts = [[] for _ in range(CLIENTS)]
  for k in range(num_classes):
    holders = np.flatnonzero((classes == k).any(axis=1))
    samples = rng.permutation(np.flatnonzero(labels == k))
    for client, chunk in zip(holders, np.array_split(samples, len(holders))):
      parts[client].append(chunk)
  return [np.sort(np.concatenate(p)) for p in parts]


def split(indices: np.ndarray, labels: np.ndarray, rng: np.random.Generator
          ) -> tuple[np.ndarray, np.ndarray]:
  """75/25 per class: `round(0.25 n)` of a class's n samples (clipped to
  `[1, n - 1]`) go to the test side."""
  test = []
  for k in np.unique(labels[indices]):
    of_k = indices[labels[indices] == k]
    n = len(of_k)
    num_test = min(max(int(np.floor(TEST_FRACTION * n + 0.5)), 1), n - 1) if n > 1 else 0
    test.append(rng.permutation(of_k)[:num_test])
  test = np.sort(np.concatenate(test))
  return np.setdiff1d(indices, test), test


def make_model(num_inputs: int, num_classes: int) -> nn.Module:
  return nn.Sequential(nn.Flatten(), nn.Linear(num_inputs, HIDDEN[0]), nn.ReLU(),
                       nn.Linear(HIDDEN[0], HIDDEN[1]), nn.ReLU(),
                       nn.Linear(HIDDEN[1], num_classes))


def summary(history: list[dict], kind: str) -> dict[str, float]:
  values = [h[f"{kind}_accuracy"] for h in history]
  last = history[-FINAL_WINDOW:]
  return {"best": float(max(values)), "final": float(np.mean(values[-FINAL_WINDOW:])),
          "client_mean": float(np.mean([h[f"{kind}_client_mean"] for h in last])),
          "client_std": float(np.mean([h[f"{kind}_client_std"] for h in last]))}


def write_plots(results: dict, out: str) -> list[str]:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  run = results["runs"][0]
  fig, ax = plt.subplots(figsize=(7, 4.5))
  ax.plot([h["round"] for h in run["history"]],
          [100 * h["personalized_accuracy"] for h in run["history"]],
          label=run["algorithm"])
  ax.set_xlabel("round")
  ax.set_ylabel("personalized accuracy (%)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(out, "accuracy.png"), dpi=120)
  plt.close(fig)

  panels = [("data: samples per class", np.asarray(results["class_counts"])),
            (run["algorithm"], np.asarray(run["output_norms"]))]
  fig, axes = plt.subplots(1, 2, figsize=(7.2, 3.2))
  for ax, (title, values) in zip(axes, panels):
    image = ax.imshow(values, aspect="auto", cmap="viridis")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    fig.colorbar(image, ax=ax, fraction=0.046)
  fig.tight_layout()
  fig.savefig(os.path.join(out, "output_norms.png"), dpi=110)
  plt.close(fig)
  return ["accuracy.png", "output_norms.png"]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=40)
  parser.add_argument("--out", default="runs/torch_fedavg", help="output directory")
  parser.add_argument("--threads", type=int, default=None,
                      help="torch.set_num_threads (default: torch's own)")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  if args.threads is not None:
    torch.set_num_threads(args.threads)
  os.makedirs(args.out, exist_ok=True)

  digits = load_digits()
  images = (digits.images / 16.0).astype(np.float32).reshape(len(digits.images), -1)
  labels = digits.target.astype(np.int64)
  num_classes = int(labels.max()) + 1
  rng = np.random.default_rng(args.seed)
  torch.manual_seed(args.seed)
  splits = [split(idx, labels, rng) for idx in partition(labels, num_classes, rng)]
  train_x = [torch.from_numpy(images[tr]) for tr, _ in splits]
  train_y = [torch.from_numpy(labels[tr]) for tr, _ in splits]
  test_x = [torch.from_numpy(images[te]) for _, te in splits]
  test_y = [torch.from_numpy(labels[te]) for _, te in splits]
  num_train = np.array([len(tr) for tr, _ in splits])
  num_test = np.array([len(te) for _, te in splits])
  class_counts = np.stack([np.bincount(labels[tr], minlength=num_classes)
                           for tr, _ in splits])
  weights = num_train / num_train.sum()

  global_model = make_model(images.shape[1], num_classes)
  clients = [make_model(images.shape[1], num_classes) for _ in range(CLIENTS)]
  optimizers = [torch.optim.SGD(m.parameters(), lr=LR) for m in clients]
  criterion = nn.CrossEntropyLoss()

  history = []
  started = time.perf_counter()
  for t in range(args.rounds):
    losses = []
    for model, optimizer, x, y in zip(clients, optimizers, train_x, train_y):
      for new, old in zip(global_model.parameters(), model.parameters()):
        old.data = new.data.clone()  # PFLlib's Client.set_parameters
      model.train()
      total, steps = torch.zeros(()), 0
      for _ in range(EPOCHS):
        order = torch.randperm(len(y))
        for start in range(0, len(y), BATCH):
          idx = order[start:start + BATCH]
          optimizer.zero_grad()
          loss = criterion(model(x[idx]), y[idx])
          loss.backward()
          optimizer.step()
          total += loss.detach()
          steps += 1
      losses.append(total.item() / steps)

    states = [m.state_dict() for m in clients]
    global_model.load_state_dict(
        {k: sum(float(w) * s[k] for w, s in zip(weights, states)) for k in states[0]})

    global_model.eval()
    with torch.no_grad():
      correct = np.array([int((global_model(x).argmax(1) == y).sum())
                          for x, y in zip(test_x, test_y)])
    own = correct / num_test
    record = {"round": t + 1, "train_loss": float(np.mean(losses)),
              "dropped_clients": [], "faulty_clients": []}
    for kind in ("personalized", "global"):  # FedAvg: every client holds the global model
      record.update({f"{kind}_accuracy": float(correct.sum() / num_test.sum()),
                     f"{kind}_client_mean": float(own.mean()),
                     f"{kind}_client_std": float(own.std())})
    history.append(record)
  seconds = time.perf_counter() - started

  norms = global_model[-1].weight.detach().norm(dim=1).numpy()
  run = {"algorithm": "fedavg", "seed": args.seed,
         "personalized_accuracy": summary(history, "personalized"),
         "global_accuracy": summary(history, "global"), "exclusive_accuracy": None,
         "faulty_uploads": 0, "history": history, "seconds": seconds,
         "output_norms": np.tile(norms, (CLIENTS, 1)).tolist()}
  results = {"config": {"dataset": "digits", "partition": "pathological",
                        "clients": CLIENTS, "classes_per_client": CLASSES_PER_CLIENT,
                        "rounds": args.rounds, "local_epochs": EPOCHS,
                        "batch_size": BATCH, "lr": LR, "model": "mlp",
                        "algorithms": ["fedavg"], "seeds": [args.seed],
                        "implementation": f"torch {torch.__version__}",
                        "threads": torch.get_num_threads()},
             "class_counts": class_counts.tolist(), "runs": [run]}
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  written = write_plots(results, args.out)
  acc = run["personalized_accuracy"]
  print(f"fedavg (torch) seed {args.seed}: personalized best {acc['best']:.4f} "
        f"final {acc['final']:.4f} ({seconds:.1f} s)")
  print(f"wrote {os.path.join(args.out, 'results.json')} and {', '.join(written)}")


if __name__ == "__main__":
  main()
