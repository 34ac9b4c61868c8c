"""Bytes each method sends per round in a Flower federation (`pflax.flower`).

Runs each algorithm for `--rounds` rounds through `PflaxStrategy` and the
client app with real Flower messages delivered in this process
(`pflax.flower.run_in_process`: the same records a deployment sends, without
the network), and prints the arrays' bytes per round, as Flower counts them
(`ArrayRecord.count_bytes`: NumPy `.npy` bytes of every array): the server's
train messages (each participant's starting model and, for methods that have
one, its loss context), the trained models it receives, and the models it sends
for evaluation (each client's models of every evaluated kind). Per client and
round, next to the model's own size (its parameters in float32), so the ratio
says what a method costs over FedAvg's one model each way. Registration (once
per run: each client's class counts, input shape and test size, a few hundred
bytes) is not counted.

  python benchmarks/flower_traffic.py                  # digits, MLP, 20 clients
  python benchmarks/flower_traffic.py --out benchmarks/results/flower_traffic.md
  python benchmarks/flower_traffic.py --quick          # smoke run
"""

import argparse
import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

import jax  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

from pflax import flower  # pylint: disable=wrong-import-position
from pflax import simulate  # pylint: disable=wrong-import-position

ALGORITHMS = ("fedavg", "fedprox", "cwfedavg", "fedclassavg", "fedsa", "feddwa",
              "fedrema", "local")


def model_bytes(config: simulate.ExperimentConfig) -> int:
  """Bytes of one client's model parameters in float32."""
  setup = simulate.prepare(config, 0)
  params = setup.model.init(jax.random.key(0),
                            np.zeros((1, *setup.input_shape), np.float32))["params"]
  return sum(int(np.size(x)) * 4 for x in jax.tree.leaves(params))


def traffic(name: str, config: simulate.ExperimentConfig) -> dict[str, float]:
  """Mean bytes per client and round: sent for training, received, sent for
  evaluation."""
  strategy = flower.run_in_process(flower.Experiment(name, config, 0))
  rounds = strategy.results().config["flower"]["bytes_per_round"]
  participants = max(1, round(config.participation * config.clients))
  per = lambda key, n: float(np.mean([r[key] for r in rounds])) / n
  return {"train_sent": per("train_sent", participants),
          "train_received": per("train_received", participants),
          "evaluate_sent": per("evaluate_sent", config.clients)}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS))
  p.add_argument("--clients", type=int, default=20)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--model", default="auto")
  p.add_argument("--out", default=None, help="also write the table here (Markdown)")
  p.add_argument("--quick", action="store_true",
                 help="smoke run: 3 clients, 1 round, fedavg and feddwa")
  args = p.parse_args()
  if args.quick:
    args.clients, args.rounds, args.algorithms = 3, 1, ["fedavg", "feddwa"]
  config = simulate.ExperimentConfig(clients=args.clients, rounds=args.rounds,
                                     local_epochs=1, model=args.model)
  size = model_bytes(config)
  lines = [f"digits, model {args.model}, {args.clients} clients, all participating, "
           f"{args.rounds} rounds; one model: {size:,} bytes of float32 parameters. "
           "Bytes per client and round, mean over rounds (ratio to one model):", "",
           "| algorithm | train sent | train received | evaluation sent |",
           "|---|---:|---:|---:|"]
  for name in args.algorithms:
    t = traffic(name, config)
    cells = " | ".join(f"{t[k]:,.0f} ({t[k] / size:.2f}x)"
                       for k in ("train_sent", "train_received", "evaluate_sent"))
    lines.append(f"| {name} | {cells} |")
  table = "\n".join(lines)
  print(table)
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      f.write(table + "\n")


if __name__ == "__main__":
  main()
