"""One round of 1,000 CNN clients on one machine, in chunks under a memory budget.

Every client holds the MNIST CNN (`pflax.models.CNN(10)` on 28x28x1 inputs,
582,026 float32 parameters, 2.33 MB) and `--samples` random samples; the round
is FedAvg's: all clients start from the global model, train one local epoch
(batches of `--batch-size`, SGD lr 0.01, no optimizer state), and the server
averages the M trained models with `pflax.aggregate.fedavg`.

Local training is `pflax.train.make_trainer(..., strategy="map",
memory_budget=W)`: the chunk size is `pflax.train.chunk_size_for_budget` of
`pflax.train.bytes_per_client` (XLA's memory analysis of one client). The
script prints, as Markdown:

- the memory per client and the chunk size;
- what XLA's memory analysis says the chunked program and a single vmap over
  all M clients would need (arguments + outputs + temporaries; nothing is
  allocated for the vmap);
- peak resident memory of the process (`VmHWM`) before and after the round,
  the time of the first round (compilation included) and of later rounds,
  samples/s, and the time of the aggregation.

Usage:
  python benchmarks/many_clients.py                  # M = 1000, 20 samples, 4 GiB
  python benchmarks/many_clients.py --budget-gib 1 --rounds 1
  python benchmarks/many_clients.py --quick          # smoke run: M = 20
"""

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pflax import losses
from pflax import models
from pflax import train
import pflax

GIB = 2**30
LR, CLASSES = 0.01, 10


def peak_rss() -> int:
  """Peak resident set size of this process in bytes (`VmHWM`)."""
  with open("/proc/self/status") as status:
    for line in status:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) * 1024
  raise RuntimeError("VmHWM not found in /proc/self/status.")


def analysed(fn, *args) -> tuple[int, int, float]:
  """Total and temporary bytes of `jax.jit(fn)` per XLA (no run), compile seconds.

  Total is arguments + outputs + temporaries - aliased.
  """
  start = time.perf_counter()
  stats = jax.jit(fn).lower(*args).compile().memory_analysis()
  seconds = time.perf_counter() - start
  total = (stats.argument_size_in_bytes + stats.output_size_in_bytes
           + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
  return int(total), int(stats.temp_size_in_bytes), seconds


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--clients", type=int, default=1000, help="M")
  parser.add_argument("--samples", type=int, default=20, help="samples per client")
  parser.add_argument("--batch-size", type=int, default=10)
  parser.add_argument("--budget-gib", type=float, default=4.0,
                      help="memory budget W of the clients training at once")
  parser.add_argument("--rounds", type=int, default=1,
                      help="rounds to run (the first one compiles)")
  parser.add_argument("--quick", action="store_true",
                      help="smoke run: M = 20, a budget of 8.5 clients")
  args = parser.parse_args()
  if args.quick:
    args.clients = 20
  m, n = args.clients, args.samples

  model = models.CNN(CLASSES)
  optimizer = optax.sgd(LR)

  def loss_fn(params, context, batch, key):
    del context, key
    logits = model.apply({"params": params}, batch.x)
    return losses.cross_entropy(logits, batch.y, batch.mask)

  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(m, n, 28, 28, 1)).astype(np.float32))
  y = jnp.asarray(rng.integers(0, CLASSES, size=(m, n)).astype(np.int32))
  valid = jnp.ones((m, n), bool)
  counts = jnp.full((m,), n)
  global_params = model.init(jax.random.PRNGKey(0), x[0, :1])["params"]
  size = sum(leaf.size for leaf in jax.tree.leaves(global_params))

  def round_inputs(global_params, r):
    start = jax.tree.map(jnp.copy, pflax.tree.broadcast(global_params, m))
    return (start, train.init_opt_state(optimizer, start), None, x, y, valid,
            jax.random.split(jax.random.PRNGKey(r), m))

  one = functools.partial(train.train_client, loss_fn, optimizer, epochs=1,
                          batch_size=args.batch_size)
  abstract = jax.eval_shape(round_inputs, global_params, 0)
  start = time.perf_counter()
  per_client = train.bytes_per_client(one, *abstract)
  per_client_seconds = time.perf_counter() - start
  budget = (per_client * 8 + per_client // 2) if args.quick else int(
      args.budget_gib * GIB)
  chunk = train.chunk_size_for_budget(per_client, m, budget)
  chunked = analysed(train.map_clients(one, "map", chunk), *abstract)
  vmapped = analysed(jax.vmap(one), *abstract)

  trainer = train.make_trainer(loss_fn, optimizer, epochs=1,
                               batch_size=args.batch_size, strategy="map",
                               memory_budget=budget)
  aggregate = jax.jit(pflax.aggregate.fedavg)
  round_times, aggregate_times = [], []
  for r in range(args.rounds):
    inputs = jax.block_until_ready(round_inputs(global_params, r))
    if r == 0:
      rss_before = peak_rss()
    start = time.perf_counter()
    result = jax.block_until_ready(trainer(*inputs))
    round_times.append(time.perf_counter() - start)
    start = time.perf_counter()
    global_params = jax.block_until_ready(aggregate(result.params, counts))
    aggregate_times.append(time.perf_counter() - start)
    del inputs, result
  finite = all(bool(jnp.all(jnp.isfinite(leaf)))
                    for leaf in jax.tree.leaves(global_params))

  # Without a second round, the first one minus the two compilations it runs
  # (`bytes_per_client` and the chunked program), timed above on the same programs.
  if len(round_times) > 1:
    steady, steady_name = min(round_times[1:]), "round (steady)"
  else:
    steady = round_times[0] - per_client_seconds - chunked[2]
    steady_name = "round without compilation (first minus compilations)"
  mb = lambda b: f"{b / 1e6:,.1f} MB"
  gb = lambda b: f"{b / GIB:,.2f} GiB"
  print(f"CNN, {size:,} parameters ({mb(4 * size)}) per client; M = {m}, "
        f"{n} samples per client, batch {args.batch_size}, 1 local epoch, SGD; "
        f"{jax.device_count()} {jax.default_backend()} device(s)\n")
  print("| quantity | value |\n|---|---:|")
  rows = [
      ("memory budget W", gb(budget)),
      ("bytes per client (`bytes_per_client`)", mb(per_client)),
      ("chunk size C (`chunk_size_for_budget`)", f"{chunk} ({-(-m // chunk)} chunks)"),
      ("XLA analysis, chunked round: total (temporaries)",
       f"{gb(chunked[0])} ({gb(chunked[1])})"),
      ("XLA analysis, one vmap over all M: total (temporaries)",
       f"{gb(vmapped[0])} ({gb(vmapped[1])})"),
      ("M x bytes per client", gb(m * per_client)),
      ("peak RSS with the round's inputs ready", gb(rss_before)),
      ("peak RSS after training and aggregation", gb(peak_rss())),
      ("compilation: `bytes_per_client`, chunked program",
       f"{per_client_seconds:.1f} s, {chunked[2]:.1f} s"),
      ("first round, with compilation", f"{round_times[0]:.1f} s"),
      (steady_name, f"{steady:.1f} s"),
      ("samples/s", f"{m * n / steady:,.0f}"),
      ("FedAvg over the M trained models" + (" (steady)" if len(round_times) > 1
                                             else " (with compilation)"),
       f"{min(aggregate_times):.2f} s"),
      ("aggregated model finite", str(finite)),
  ]
  for name, value in rows:
    print(f"| {name} | {value} |")


if __name__ == "__main__":
  main()
