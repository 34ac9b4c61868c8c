"""Throughput of one round of local training: pflax against a JAX loop and PyTorch.

One round is one local epoch of every client: 100 samples per client, batches
of 10 (10 SGD steps, lr 0.01), softmax cross-entropy, every client starting
from the same global parameters. Models: the MNIST CNN (`pflax.models.CNN(10)`
on 28x28x1 inputs, 582,026 parameters) and the 784-200-200-10 MLP
(`pflax.models.MLP(10)` on flat 784 inputs). Inputs are random: throughput does
not depend on the values.

Implementations:
  pflax <strategy>  `pflax.train.make_trainer(..., strategy=...)` for "auto"
                    (the default), "vmap", "loop", "map" (`--chunk-size`) and
                    "steps" (unchunked);
  jax loop          a Python loop over clients of a jitted per-client epoch
                    (`jax.random.permutation`, `lax.scan` over the batches,
                    fully unrolled, which is its fastest setting on XLA-CPU);
  torch             a PFLlib-style PyTorch loop: per client, copy the global
                    weights, `model.train()`, then per mini-batch `zero_grad`,
                    `backward`, `step` (no DataLoader), with torch's default
                    threads and with `torch.set_num_threads(1)`.

Each (model, M, implementation) runs in `--repeats` separate processes,
interleaved so that load on a shared machine hits all implementations alike; a
process times `--rounds` rounds after a first (compiling) round (short rounds
more, until 2 s are timed), and reports the median round. The table gives the median over processes: samples/s
(`M * 100 / round time`), rounds/s, and the compile time (first round minus a
steady round).

With `--plot FILE`, rounds/s and samples/s against M are drawn per model and
implementation (the scaling run below); `--out FILE` also writes the tables.

Usage:
  python benchmarks/training.py                          # M in {20, 100}, both models
  python benchmarks/training.py --clients 20 --models mlp --repeats 5
  python benchmarks/training.py --clients 10 20 50 100 200 500 1000 \
      --impls "pflax auto" "jax loop" --out benchmarks/results/training_scaling.md \
      --plot benchmarks/results/training_scaling.png   # rounds/s vs M
  python benchmarks/training.py --quick                  # smoke run (M = 4, 2 steps)
"""

import argparse
import itertools
import json
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any

SAMPLES, BATCH, LR, CLASSES = 100, 10, 0.01, 10
IMPLS = ("pflax auto", "pflax vmap", "pflax loop", "pflax map", "pflax steps",
         "jax loop", "torch", "torch 1 thread")
INPUT_SHAPES = {"cnn": (28, 28, 1), "mlp": (784,)}


def _data(num_clients: int, samples: int, shape: tuple[int, ...]) -> tuple[Any, Any]:
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  x = rng.normal(size=(num_clients, samples, *shape)).astype(np.float32)
  y = rng.integers(0, CLASSES, size=(num_clients, samples)).astype(np.int32)
  return x, y


MIN_SECONDS = 2.0
"""Short rounds are repeated beyond `--rounds` until this many seconds are timed."""


def _time_rounds(run_round, rounds: int, budget: float) -> dict[str, float]:
  """First-round time and medians of the further rounds (wall, CPU s).

  At least `rounds` rounds are timed, and more until `MIN_SECONDS` have passed
  (a round of the MLP at M = 20 takes 30 ms); none starts once the process has
  run `budget` s.
  """
  start = time.perf_counter()
  run_round(0)
  first = time.perf_counter() - start
  times, cpu_times = [], []
  for r in itertools.count(1):
    if times and (first + sum(times) > budget
                  or (r > rounds and sum(times) >= MIN_SECONDS)):
      break
    start, cpu_start = time.perf_counter(), time.process_time()
    run_round(r)
    times.append(time.perf_counter() - start)
    cpu_times.append(time.process_time() - cpu_start)
  steady = statistics.median(times)
  return {"round": steady, "cpu": statistics.median(cpu_times),
          "compile": max(first - steady, 0.0)}


def jax_worker(impl: str, model_name: str, num_clients: int, samples: int,
               rounds: int, budget: float, unroll: int | None,
               chunk_size: int) -> dict[str, float]:
  """Times one pflax strategy or the plain JAX loop."""
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_threefry_partitionable", False)
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  from pflax import losses  # pylint: disable=g-import-not-at-top
  from pflax import models  # pylint: disable=g-import-not-at-top
  from pflax import train  # pylint: disable=g-import-not-at-top

  model = models.CNN(CLASSES) if model_name == "cnn" else models.MLP(CLASSES)
  shape = INPUT_SHAPES[model_name]
  x, y = _data(num_clients, samples, shape)
  optimizer = optax.sgd(LR)
  global_params = jax.jit(model.init)(jax.random.key(0),
                                      jnp.zeros((1, *shape)))["params"]

  if impl == "jax loop":
    steps = samples // BATCH

    def ce(params, bx, by):
      logits = model.apply({"params": params}, bx)
      return optax.softmax_cross_entropy_with_integer_labels(logits, by).mean()

    @jax.jit
    def client_epoch(params, cx, cy, key):
      opt_state = optimizer.init(params)
      order = jax.random.permutation(key, samples)[:steps * BATCH]

      def step(carry, idx):
        params, opt_state = carry
        loss, grads = jax.value_and_grad(ce)(params, cx[idx], cy[idx])
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

      (params, _), step_losses = jax.lax.scan(
          step, (params, opt_state), order.reshape(steps, BATCH), unroll=steps)
      return params, step_losses.mean()

    xs = [jnp.asarray(a) for a in x]
    ys = [jnp.asarray(a) for a in y]

    def run_round(r):
      keys = jax.random.split(jax.random.key(r), num_clients)
      outs = [client_epoch(global_params, xs[i], ys[i], keys[i])
              for i in range(num_clients)]
      jax.block_until_ready(outs)

    return _time_rounds(run_round, rounds, budget)

  def loss_fn(params, context, batch, key):
    del context, key
    logits = model.apply({"params": params}, batch.x)
    return losses.cross_entropy(logits, batch.y, batch.mask)

  strategy = impl.split()[1]
  kwargs = {} if unroll is None else {"unroll": unroll}
  trainer = train.make_trainer(loss_fn, optimizer, epochs=1, batch_size=BATCH,
                               strategy=strategy,
                               chunk_size=chunk_size if strategy == "map" else None,
                               **kwargs)
  params = jax.tree.map(lambda a: jnp.broadcast_to(a, (num_clients, *a.shape)),
                        global_params)
  opt_state = train.init_opt_state(optimizer, params)
  xs, ys = jnp.asarray(x), jnp.asarray(y)
  valid = jnp.ones((num_clients, samples), bool)

  def run_round(r):
    keys = jax.random.split(jax.random.key(r), num_clients)
    jax.block_until_ready(trainer(params, opt_state, None, xs, ys, valid, keys))

  return _time_rounds(run_round, rounds, budget)


def torch_worker(impl: str, model_name: str, num_clients: int, samples: int,
                 rounds: int, budget: float) -> dict[str, float]:
  """Times the PFLlib-style PyTorch loop."""
  import torch  # pylint: disable=g-import-not-at-top
  from torch import nn  # pylint: disable=g-import-not-at-top
  if impl == "torch 1 thread":
    torch.set_num_threads(1)
  torch.manual_seed(0)
  if model_name == "cnn":  # PFLlib's FedAvgCNN(in_features=1, dim=1024)
    make = lambda: nn.Sequential(
        nn.Conv2d(1, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, CLASSES))
    shape = (1, 28, 28)
  else:
    make = lambda: nn.Sequential(
        nn.Linear(784, 200), nn.ReLU(), nn.Linear(200, 200), nn.ReLU(),
        nn.Linear(200, CLASSES))
    shape = (784,)
  x, y = _data(num_clients, samples, shape)
  xs = [torch.from_numpy(a) for a in x]
  ys = [torch.from_numpy(a).long() for a in y]
  global_model = make()
  clients = [make() for _ in range(num_clients)]
  optimizers = [torch.optim.SGD(m.parameters(), lr=LR) for m in clients]
  criterion = nn.CrossEntropyLoss()

  def run_round(r):
    del r
    for model, optimizer, cx, cy in zip(clients, optimizers, xs, ys):
      for new, old in zip(global_model.parameters(), model.parameters()):
        old.data = new.data.clone()  # PFLlib's Client.set_parameters
      model.train()
      order = torch.randperm(samples)
      for start in range(0, samples, BATCH):
        idx = order[start:start + BATCH]
        optimizer.zero_grad()
        loss = criterion(model(cx[idx]), cy[idx])
        loss.backward()
        optimizer.step()

  return _time_rounds(run_round, rounds, budget)


def measure(args: argparse.Namespace, impl: str, model: str, m: int,
            samples: int, rounds: int) -> dict[str, float] | None:
  """Runs one configuration in a fresh process; None if it is unavailable."""
  cmd = [sys.executable, __file__, "--worker", impl, "--models", model,
         "--clients", str(m), "--samples", str(samples), "--rounds", str(rounds),
         "--chunk-size", str(args.chunk_size), "--budget", str(args.budget)]
  if args.unroll is not None:
    cmd += ["--unroll", str(args.unroll)]
  out = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if out.returncode != 0:
    if impl.startswith("torch") and "No module named 'torch'" in out.stderr:
      return None
    raise RuntimeError(f"{impl} {model} M={m} failed:\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def markdown(rows: list[dict[str, Any]], samples: int) -> str:
  lines = ["| model | M | implementation | samples/s | rounds/s | samples/CPU-s "
           "| compile s | processes |", "|---|---:|---|---:|---:|---:|---:|---:|"]
  for row in rows:
    lines.append(f"| {row['model']} | {row['M']} | {row['impl']} | "
                 f"{row['M'] * samples / row['round']:,.0f} | "
                 f"{1 / row['round']:.2f} | {row['M'] * samples / row['cpu']:,.0f} | "
                 f"{row['compile']:.1f} | {row['runs']} |")
  keyed = {(r["model"], r["M"], r["impl"]): r["round"] for r in rows}
  measured = {r["impl"] for r in rows}
  others = [o for o in ("jax loop", "torch", "torch 1 thread") if o in measured]
  if "pflax auto" not in measured or not others:
    return "\n".join(lines)
  lines += ["", "| model | M | " + " | ".join(f"auto / {o}" for o in others) + " |",
            "|---|---:|" + "---:|" * len(others)]
  for model, m in dict.fromkeys((r["model"], r["M"]) for r in rows):
    auto = keyed.get((model, m, "pflax auto"))
    cells = []
    for other in others:
      base = keyed.get((model, m, other))
      cells.append("" if auto is None or base is None else f"{base / auto:.2f}x")
    lines.append(f"| {model} | {m} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def plot(rows: list[dict[str, Any]], samples: int, path: str) -> None:
  """Rounds/s and samples/s against M (log-log), a line per model and implementation."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
  for model, impl in dict.fromkeys((r["model"], r["impl"]) for r in rows):
    line = sorted((r["M"], r["round"]) for r in rows
                  if (r["model"], r["impl"]) == (model, impl))
    m, seconds = zip(*line)
    style = "-o" if impl.startswith("pflax") else "--s"
    left.plot(m, [1 / t for t in seconds], style, markersize=3, label=f"{model} {impl}")
    right.plot(m, [x * samples / t for x, t in line], style, markersize=3,
               label=f"{model} {impl}")
  left.set(xscale="log", yscale="log", xlabel="clients M", ylabel="rounds/s")
  right.set(xscale="log", yscale="log", xlabel="clients M", ylabel="samples/s")
  for ax in (left, right):
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
  fig.suptitle(f"local training, 1 epoch of {samples} samples per client, batch {BATCH}",
               fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--clients", type=int, nargs="+", default=[20, 100],
                      help="numbers of clients M (default: 20 100)")
  parser.add_argument("--models", nargs="+", default=["cnn", "mlp"],
                      choices=sorted(INPUT_SHAPES))
  parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS,
                      metavar="IMPL", help=f"implementations (default: all of {IMPLS})")
  parser.add_argument("--repeats", type=int, default=3,
                      help="processes per configuration; the median is reported")
  parser.add_argument("--rounds", type=int, default=3,
                      help="timed rounds per process, after the first (at least; "
                      f"short rounds repeat until {MIN_SECONDS:g} s are timed)")
  parser.add_argument("--budget", type=float, default=120.0,
                      help="seconds per process after which no further round is "
                      "timed; a configuration whose process ran over twice this "
                      "is not run in more processes")
  parser.add_argument("--samples", type=int, default=SAMPLES,
                      help="samples per client (default: 100)")
  parser.add_argument("--chunk-size", type=int, default=10,
                      help='clients per chunk for the "map" strategy')
  parser.add_argument("--unroll", type=int, default=None,
                      help="override make_trainer's unroll (default: its default)")
  parser.add_argument("--quick", action="store_true",
                      help="M = 4, 20 samples (2 steps), 1 process, 1 round")
  parser.add_argument("--out", default=None, help="also write the tables to this file")
  parser.add_argument("--plot", default=None,
                      help="draw rounds/s and samples/s against M into this PNG")
  parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()

  if args.worker:
    model, m = args.models[0], args.clients[0]
    if args.worker.startswith("torch"):
      result = torch_worker(args.worker, model, m, args.samples, args.rounds,
                            args.budget)
    else:
      result = jax_worker(args.worker, model, m, args.samples, args.rounds,
                          args.budget, args.unroll, args.chunk_size)
    print(json.dumps(result))
    return

  if args.quick:
    args.clients, args.samples, args.repeats, args.rounds = [4], 20, 1, 1
    args.chunk_size = min(args.chunk_size, 2)
  configs = [(model, m, impl) for model in args.models for m in args.clients
             for impl in args.impls]
  results: dict[tuple[str, int, str], list[dict[str, float]]] = {}
  skipped, missing = set(), set()
  for repeat in range(args.repeats):
    for config in configs:
      if config in skipped:
        continue
      model, m, impl = config
      start = time.perf_counter()
      out = measure(args, impl, model, m, args.samples, args.rounds)
      if time.perf_counter() - start > 2 * args.budget:
        skipped.add(config)  # too slow to repeat: report the one process
      if out is None:
        skipped.add(config)
        missing.add(impl)
        continue
      results.setdefault(config, []).append(out)
      print(f"[{repeat + 1}/{args.repeats}] {model} M={m} {impl}: "
            f"{m * args.samples / out['round']:,.0f} samples/s "
            f"({m * args.samples / out['cpu']:,.0f} per CPU second)", file=sys.stderr)
  rows = [{"model": model, "M": m, "impl": impl, "runs": len(runs),
           **{k: statistics.median(r[k] for r in runs)
              for k in ("round", "cpu", "compile")}}
          for (model, m, impl), runs in results.items()]
  if missing:
    print(f"skipped (torch not installed): {sorted(missing)}", file=sys.stderr)
  text = (f"{args.samples} samples per client, batch {BATCH}, 1 epoch; median of "
          f"{args.repeats} processes x {args.rounds} rounds\n\n"
          + markdown(rows, args.samples))
  print(text)
  if args.out:
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(text + "\n")
  if args.plot:
    plot(rows, args.samples, args.plot)


if __name__ == "__main__":
  main()
