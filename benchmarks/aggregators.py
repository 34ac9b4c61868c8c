"""Times pflax's aggregators against memory and matmul floors measured in-process.

The model is the 4-layer CIFAR CNN of the cwFedAvg paper (conv 5x5x3x32, conv
5x5x32x64, dense 1600x512, dense 512xK; 878,538 parameters per client at K = 10),
stacked over M clients and drawn with `jax.random.normal`. Every function is
jitted, warmed up, and timed as the median of `--repeats` runs; the functions
take turns within each repeat, so load changes hit floors and aggregators alike.

Floors, measured in the same process on the same stacked parameters:
  read        one streaming read: `jnp.tensordot(w, x, 1)` per leaf, w `(M,)`;
  read+write  `x + 1` per leaf;
  dense mix   one `(M, M)` mix `jnp.tensordot(A, x, 1)` per leaf.
Each aggregator's time is printed as a ratio to its floor; the targets in
`TARGETS` are judged at `TARGET_SIZE` (M = 100, K = 10) only.

Usage:
  python benchmarks/aggregators.py                  # M in {10, 100}, K in {10, 100}
  python benchmarks/aggregators.py --clients 100 --classes 10 --repeats 9
  python benchmarks/aggregators.py --only fedsa     # a subset; floors always run
  python benchmarks/aggregators.py --quick          # tiny smoke run (seconds)
"""

import argparse
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

if "--quick" in sys.argv:  # a smoke run: compile fast, before jax is imported
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_backend_optimization_level=0"
                             " --xla_cpu_use_fusion_emitters=false").strip()

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

# Run from a checkout without installing pflax.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from pflax import aggregate  # pylint: disable=g-import-not-at-top
from pflax import tree  # pylint: disable=g-import-not-at-top


class Model(NamedTuple):
  """Layer sizes of the CNN: conv kernels `(k, k, in, out)`, dense `(in, out)`."""
  conv_0: tuple[int, ...]
  conv_1: tuple[int, ...]
  hidden_0: tuple[int, ...]


FULL = Model(conv_0=(5, 5, 3, 32), conv_1=(5, 5, 32, 64), hidden_0=(1600, 512))
TINY = Model(conv_0=(3, 3, 3, 4), conv_1=(3, 3, 4, 8), hidden_0=(32, 16))


class Target(NamedTuple):
  floor: str
  ratio: float | None


TARGET_SIZE = (100, 10)  # (M, K) at which the targets are judged


TARGETS = {
    "fedavg": Target("read", 1.5),
    "cw_fedavg (All)": Target("read+write", 1.6),
    "cw_fedavg (Output)": Target("read+write", 1.6),
    "fedclassavg": Target("read+write", None),
    "feddwa": Target("dense mix", 2.5),
    "fedrema": Target("dense mix", None),
    "fedsa": Target("dense mix", 8.0),
}


def layer_shapes(model: Model, num_classes: int) -> dict[str, Any]:
  """Per-client leaf shapes, nested like pflax's models."""
  layers = {
      "features": {"conv_0": model.conv_0, "conv_1": model.conv_1},
      "classifier": {"hidden_0": model.hidden_0,
                     "output": (model.hidden_0[-1], num_classes)},
  }
  return {part: {name: {"kernel": kernel, "bias": (kernel[-1],)}
                 for name, kernel in group.items()}
          for part, group in layers.items()}


def stacked_params(key: jax.Array, model: Model, num_clients: int, num_classes: int,
                   copies: int = 1) -> list[dict[str, Any]]:
  """`copies` random stacked CNN parameter trees, leaves `(M, ...)`.

  One `jax.random.normal` draw sliced into the leaves: a draw per leaf would
  compile a random-bits kernel per leaf (seconds in a smoke run).
  """
  shapes, treedef = jax.tree.flatten(layer_shapes(model, num_classes),
                                     is_leaf=lambda x: isinstance(x, tuple))
  sizes = [int(np.prod(shape)) for shape in shapes]
  flat = jax.random.normal(key, (copies, num_clients, sum(sizes)))
  offsets = np.cumsum([0] + sizes)
  return [jax.tree.unflatten(treedef, [
      flat[c, :, start:start + size].reshape(num_clients, *shape)
      for start, size, shape in zip(offsets, sizes, shapes)]) for c in range(copies)]


def _apply_classifier(classifier: dict[str, Any], h: jax.Array) -> jax.Array:
  hidden = jax.nn.relu(h @ classifier["hidden_0"]["kernel"]
                       + classifier["hidden_0"]["bias"])
  return hidden @ classifier["output"]["kernel"] + classifier["output"]["bias"]


def floors() -> dict[str, Callable[..., Any]]:
  """The three floors as functions of `(params, w, A)`."""
  return {
      "read": lambda p, w, a: jax.tree.map(lambda x: jnp.tensordot(w, x, 1), p),
      "read+write": lambda p, w, a: jax.tree.map(lambda x: x + 1, p),
      "dense mix": lambda p, w, a: jax.tree.map(lambda x: jnp.tensordot(a, x, 1), p),
  }


def aggregators(model: Model) -> dict[str, Callable[..., Any]]:
  """Every aggregator as a function of `(params, received, counts, n, state, key)`."""
  feature_dim = model.hidden_0[0]
  output = tree.under("classifier", "output")

  def fedrema(p, r, c, n, state, key):
    del r, c
    logits = aggregate.probe_logits(_apply_classifier, p["classifier"], key,
                                    feature_dim)
    return aggregate.fedrema(p, n, aggregate.soft_logits(logits), state)

  return {
      "fedavg": lambda p, r, c, n, s, k: aggregate.fedavg(p, n),
      "cw_fedavg (All)": lambda p, r, c, n, s, k: aggregate.cw_fedavg(p, c),
      "cw_fedavg (Output)": lambda p, r, c, n, s, k: aggregate.cw_fedavg(
          p, c, where=output),
      "fedclassavg": lambda p, r, c, n, s, k: aggregate.fedclassavg(p, n),
      "feddwa": lambda p, r, c, n, s, k: aggregate.feddwa(p, r),
      "fedrema": fedrema,
      "fedsa": lambda p, r, c, n, s, k: aggregate.fedsa(p, n),
  }


def median_ms(fns: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]],
              repeats: int, budget: float | None = None) -> dict[str, float]:
  """Median wall time in ms of each jitted `fn(*args)`, after a warm-up call.

  The functions take turns in every repeat, so a change of load on a shared
  machine hits the floors and the aggregators alike. With a `budget` in
  seconds, no repeat starts once the timed repeats have taken that long (at
  least one runs).
  """
  for fn, args in fns.values():
    jax.block_until_ready(fn(*args))
  times: dict[str, list[float]] = {name: [] for name in fns}
  started = time.perf_counter()
  for repeat in range(repeats):
    if repeat and budget is not None and time.perf_counter() - started > budget:
      break
    for name, (fn, args) in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[name].append(time.perf_counter() - start)
  return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def run(num_clients: int, num_classes: int, model: Model, repeats: int,
        only: list[str] | None, judge: bool,
        budget: float | None = None) -> list[tuple[Any, ...]]:
  """Rows `(name, M, K, ms, ratio, floor, target, verdict)` for one size."""
  kp, kc, kw, ka, kk = jax.random.split(jax.random.key(0), 5)

  @jax.jit
  def inputs():
    params, step = stacked_params(kp, model, num_clients, num_classes, copies=2)
    received = jax.tree.map(lambda x, d: x - 0.1 * d, params, step)
    counts = jax.random.randint(kc, (num_clients, num_classes), 0, 50)
    n = jnp.sum(counts, axis=1).astype(jnp.float32)
    w = jax.random.uniform(kw, (num_clients,))
    a = jax.random.uniform(ka, (num_clients, num_clients))
    return params, received, counts, n, w, a

  params, received, counts, n, w, a = inputs()
  state = aggregate.fedrema_init(num_clients)

  fns = {name: (jax.jit(fn), (params, w, a)) for name, fn in floors().items()}
  fns.update({name: (jax.jit(fn), (params, received, counts, n, state, kk))
              for name, fn in aggregators(model).items()
              if not only or name.split(" ")[0] in only})
  ms = median_ms(fns, repeats, budget)
  rows = [(f"floor: {name}", num_clients, num_classes, ms[name], 1.0, name, None, "")
          for name in floors()]
  for name, target in TARGETS.items():
    if name not in fns:
      continue
    ratio = ms[name] / ms[target.floor]
    verdict = ("" if target.ratio is None or not judge
               else "pass" if ratio <= target.ratio else "FAIL")
    rows.append((name, num_clients, num_classes, ms[name], ratio, target.floor,
                 target.ratio if judge else None, verdict))
  return rows


def markdown(rows: list[tuple[Any, ...]]) -> str:
  lines = ["| aggregator | M | K | ms | ratio | floor | target | result |",
           "|---|---:|---:|---:|---:|---|---:|---|"]
  for name, m, k, ms, ratio, floor, target, verdict in rows:
    target_text = "" if target is None else f"<= {target:g}x"
    lines.append(f"| {name} | {m} | {k} | {ms:.1f} | {ratio:.2f}x | {floor} | "
                 f"{target_text} | {verdict} |")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--clients", type=int, nargs="+", default=[10, 100],
                      help="numbers of clients M (default: 10 100)")
  parser.add_argument("--classes", type=int, nargs="+", default=[10, 100],
                      help="numbers of classes K (default: 10 100)")
  parser.add_argument("--repeats", type=int, default=7,
                      help="timed runs per function; the median is reported")
  parser.add_argument("--only", nargs="+", default=None,
                      help="aggregators to time (e.g. fedsa feddwa); floors always run")
  parser.add_argument("--quick", action="store_true",
                      help="tiny model, M = 4, K = 3, 2 repeats, XLA backend "
                      "optimisations off: a smoke run, nothing judged")
  args = parser.parse_args()
  model = TINY if args.quick else FULL
  clients = [4] if args.quick else args.clients
  classes = [3] if args.quick else args.classes
  repeats = 2 if args.quick else args.repeats

  per_client = sum(int(np.prod(shape)) for shape in jax.tree.leaves(
      layer_shapes(model, classes[0]), is_leaf=lambda x: isinstance(x, tuple)))
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; "
        f"{per_client:,} parameters per client at K = {classes[0]}; "
        f"median of {repeats} runs")
  rows = []
  for m in clients:
    for k in classes:
      judge = not args.quick and (m, k) == TARGET_SIZE
      rows += run(m, k, model, repeats, args.only, judge)
  print(markdown(rows))


if __name__ == "__main__":
  main()
