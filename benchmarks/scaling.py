"""Aggregator scaling with clients, parameters and classes; cwFedAvg's peak memory.

Three sweeps time every aggregator of `aggregators.py` against the floors of
`aggregators.py` (read, read+write, dense mix), measured in the same process at
every size, with `aggregators.run`:

  clients  M in {10, ..., 1000}, K = 10, the small CNN "XS" (30,138 parameters
           per client): the paper's CNN would take 3.5 GB per stacked copy at
           M = 1000, and FedSA's and the dense mix's M^2 work minutes per call;
  params   four CNN widths from 30k to 3.5M parameters per client, M = 50, K = 10;
  classes  K in {10, ..., 1000}, the paper's CNN (878,538 parameters at K = 10),
           M = 50.

Memory: the compiled executables' `memory_analysis()` (arguments, outputs and
XLA temporaries) of `cw_fedavg` "All" (`where=None`) and "Output"
(`where=tree.under("classifier", "output")`), `fedavg` and `class_models`, on
stacked ResNet-18 parameter shapes (11,176,512 feature parameters and a
512 x K output layer, float32), next to the cwFedAvg paper's Table 7. Compiled
from shapes only: nothing is allocated.

Writes `scaling.md` and PNG plots into `--out` (default `benchmarks/results/`).

Usage:
  python benchmarks/scaling.py                     # everything (38 min on 2 busy cores)
  python benchmarks/scaling.py --sweeps memory     # memory only (seconds)
  python benchmarks/scaling.py --quick             # smoke run into a temporary directory
"""

import argparse
import os
import pathlib
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

# Importing aggregators sets the --quick XLA flags before jax is imported.
import aggregators as agg  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

from pflax import aggregate  # pylint: disable=g-import-not-at-top
from pflax import tree  # pylint: disable=g-import-not-at-top

RESULTS = pathlib.Path(__file__).resolve().parent / "results"

MODELS = {
    "tiny": agg.TINY,
    "XS": agg.Model(conv_0=(5, 5, 3, 8), conv_1=(5, 5, 8, 16), hidden_0=(400, 64)),
    "S": agg.Model(conv_0=(5, 5, 3, 16), conv_1=(5, 5, 16, 32), hidden_0=(800, 128)),
    "CNN": agg.FULL,
    "L": agg.Model(conv_0=(5, 5, 3, 64), conv_1=(5, 5, 64, 128), hidden_0=(3200, 1024)),
}


class Point(NamedTuple):
  """One size: a model of `MODELS`, M clients, K classes."""
  model: str
  clients: int
  classes: int


class Sweep(NamedTuple):
  """Sizes varying along one axis: "clients", "params" or "classes"."""
  axis: str
  points: tuple[Point, ...]


def sweeps(quick: bool) -> list[Sweep]:
  """The three sweeps; tiny ones for a smoke run."""
  if quick:
    return [Sweep("clients", (Point("tiny", 4, 3), Point("tiny", 8, 3))),
            Sweep("params", (Point("tiny", 4, 3), Point("XS", 4, 3))),
            Sweep("classes", (Point("tiny", 4, 3), Point("tiny", 4, 6)))]
  return [
      Sweep("clients", tuple(Point("XS", m, 10)
                             for m in (10, 20, 50, 100, 200, 500, 1000))),
      Sweep("params", tuple(Point(name, 50, 10) for name in ("XS", "S", "CNN", "L"))),
      Sweep("classes", tuple(Point("CNN", 50, k) for k in (10, 30, 100, 300, 1000))),
  ]


def num_params(shapes: Any) -> int:
  """Parameters per client of a tree of shape tuples."""
  leaves = jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))
  return sum(int(np.prod(shape)) for shape in leaves)


def point_params(point: Point) -> int:
  return num_params(agg.layer_shapes(MODELS[point.model], point.classes))


def axis_value(axis: str, point: Point) -> int:
  return {"clients": point.clients, "params": point_params(point),
          "classes": point.classes}[axis]


# Timing.

Timings = dict[Point, dict[str, tuple[float, float, str]]]  # name -> (ms, ratio, floor)


def time_points(points: Sequence[Point], repeats: int, budget: float | None,
                only: list[str] | None = None,
                log: Callable[[str], None] = print) -> Timings:
  """Times floors and aggregators at each distinct point with `aggregators.run`."""
  results: Timings = {}
  for point in dict.fromkeys(points):
    started = time.perf_counter()
    rows = agg.run(point.clients, point.classes, MODELS[point.model], repeats, only,
                   judge=False, budget=budget)
    results[point] = {name.removeprefix("floor: "): (ms, ratio, floor)
                      for name, _, _, ms, ratio, floor, _, _ in rows}
    log(f"{point.model} M={point.clients} K={point.classes}: "
        f"{time.perf_counter() - started:.0f} s")
  return results


def _column(axis: str, point: Point) -> str:
  if axis == "params":
    return f"{point.model} {point_params(point):,}"
  return f"{'M' if axis == 'clients' else 'K'} = {axis_value(axis, point)}"


def sweep_table(sweep: Sweep, results: Timings) -> str:
  """Markdown: one row per function, ms and ratio to its floor at each point."""
  names = list(results[sweep.points[0]])
  header = " | ".join(_column(sweep.axis, p) for p in sweep.points)
  lines = [f"| function | floor | {header} |",
           "|---|---|" + "---:|" * len(sweep.points)]
  for name in names:
    floor = results[sweep.points[0]][name][2]
    cells = []
    for p in sweep.points:
      ms, ratio, _ = results[p][name]
      cells.append(f"{ms:,.1f}" if name == floor else f"{ms:,.1f} ({ratio:.2f}x)")
    lines.append(f"| {name} | {'' if name == floor else floor} | "
                 + " | ".join(cells) + " |")
  return "\n".join(lines)


def _pyplot():
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


AXIS_LABELS = {"clients": "clients M", "params": "parameters per client",
               "classes": "classes K"}


def plot_sweep(sweep: Sweep, results: Timings, path: str | None = None) -> Any:
  """Time (log-log) and ratio to floor against the sweep's axis; saves to `path`."""
  plt = _pyplot()
  x = [axis_value(sweep.axis, p) for p in sweep.points]
  names = list(results[sweep.points[0]])
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
  for name in names:
    ms, ratio, floor = zip(*(results[p][name] for p in sweep.points))
    is_floor = name == floor[0]
    left.plot(x, ms, "--" if is_floor else "-o", label=name, markersize=3,
              color="gray" if is_floor else None, alpha=0.8 if is_floor else 1.0)
    if not is_floor:
      right.plot(x, ratio, "-o", markersize=3, label=f"{name} / {floor[0]}")
  left.set(xscale="log", yscale="log", xlabel=AXIS_LABELS[sweep.axis], ylabel="ms")
  right.set(xscale="log", xlabel=AXIS_LABELS[sweep.axis], ylabel="ratio to floor")
  right.axhline(1.0, color="gray", lw=0.8)
  for ax in (left, right):
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
  fig.suptitle(f"aggregator time vs {AXIS_LABELS[sweep.axis]}", fontsize=10)
  fig.tight_layout()
  if path:
    fig.savefig(path, dpi=100)
    plt.close(fig)
  return fig


# Memory of cwFedAvg (paper Table 7).

# Millions of parameters, paper Table 7 (ResNet-18): FedAvg, cwFedAvg (All), (Output).
PAPER_TABLE_7 = {10: (11.18, 111.81, 11.23), 100: (11.23, 1122.67, 16.36),
                 1000: (11.69, 11688.42, 524.68)}


def resnet18_shapes(num_classes: int) -> dict[str, Any]:
  """Per-client parameter shapes of ResNet-18 (torchvision layout, BN scale and bias).

  11,176,512 feature parameters and a `(512, K)` output layer: 11,181,642 at
  K = 10, as in the paper's Table 7.
  """
  def conv_bn(k, cin, cout):
    return {"kernel": (k, k, cin, cout), "scale": (cout,), "bias": (cout,)}

  features = {"stem": conv_bn(7, 3, 64)}
  cin = 64
  for stage, cout in enumerate((64, 128, 256, 512)):
    for block in range(2):
      layers = {"conv_0": conv_bn(3, cin, cout), "conv_1": conv_bn(3, cout, cout)}
      if cin != cout:
        layers["downsample"] = conv_bn(1, cin, cout)
      features[f"stage_{stage}_block_{block}"] = layers
      cin = cout
  return {"features": features,
          "classifier": {"output": {"kernel": (512, num_classes),
                                    "bias": (num_classes,)}}}


class MemoryRow(NamedTuple):
  function: str
  clients: int
  classes: int
  argument: int  # bytes
  output: int
  temp: int
  peak: int      # argument + output + temp - alias
  paper: float | None  # paper Table 7, bytes at float32


def memory_functions() -> dict[str, tuple[Callable[..., Any], int | None]]:
  """Functions of `(params, counts)`, each with its column of Table 7 (or None)."""
  output = tree.under("classifier", "output")
  return {
      "fedavg": (lambda p, c: aggregate.fedavg(p, jnp.sum(c, axis=1)), 0),
      "cw_fedavg (All)": (lambda p, c: aggregate.cw_fedavg(p, c), 1),
      "cw_fedavg (Output)": (lambda p, c: aggregate.cw_fedavg(p, c, where=output), 2),
      "class_models": (lambda p, c: aggregate.class_models(p, c), 1),
  }


def memory_rows(clients: Sequence[int], classes: Sequence[int]) -> list[MemoryRow]:
  """Compiles each function on ResNet-18 shapes (no allocation) and reads its sizes."""
  rows = []
  for m in clients:
    for k in classes:
      params = jax.tree.map(lambda s, m=m: jax.ShapeDtypeStruct((m, *s), jnp.float32),
                            resnet18_shapes(k), is_leaf=lambda x: isinstance(x, tuple))
      counts = jax.ShapeDtypeStruct((m, k), jnp.int32)
      for name, (fn, column) in memory_functions().items():
        stats = jax.jit(fn).lower(params, counts).compile().memory_analysis()
        paper = PAPER_TABLE_7.get(k)
        rows.append(MemoryRow(
            name, m, k, stats.argument_size_in_bytes, stats.output_size_in_bytes,
            stats.temp_size_in_bytes,
            stats.argument_size_in_bytes + stats.output_size_in_bytes
            + stats.temp_size_in_bytes - stats.alias_size_in_bytes,
            None if paper is None else paper[column] * 4e6))
  return rows


def _mb(x: float | None) -> str:
  return "" if x is None else f"{x / 1e6:,.1f}"


def memory_table(rows: Sequence[MemoryRow]) -> str:
  lines = ["| function | M | K | arguments MB | output MB | temp MB | peak MB | "
           "paper Table 7 MB |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r.function} | {r.clients} | {r.classes} | {_mb(r.argument)} | "
                 f"{_mb(r.output)} | {_mb(r.temp)} | {_mb(r.peak)} | {_mb(r.paper)} |")
  return "\n".join(lines)


def plot_memory(rows: Sequence[MemoryRow], path: str | None = None) -> Any:
  """Temp and peak MB of each function against K, one panel per M, paper dotted."""
  plt = _pyplot()
  clients = list(dict.fromkeys(r.clients for r in rows))
  fig, axes = plt.subplots(1, len(clients), figsize=(5.5 * len(clients), 4.2),
                           squeeze=False)
  for ax, m in zip(axes[0], clients):
    for i, name in enumerate(dict.fromkeys(r.function for r in rows)):
      sel = [r for r in rows if r.clients == m and r.function == name]
      k = [r.classes for r in sel]
      color = f"C{i}"
      ax.plot(k, [r.peak / 1e6 for r in sel], "-o", color=color, markersize=3,
              label=f"{name} peak")
      ax.plot(k, [max(r.temp, 1) / 1e6 for r in sel], "--", color=color,
              label=f"{name} temp")
    for j, label in enumerate(("FedAvg", "All", "Output")):
      ks = sorted(PAPER_TABLE_7)
      ax.plot(ks, [PAPER_TABLE_7[k][j] * 4 for k in ks], ":", marker="x",
              color="black", alpha=0.3 + 0.3 * j, label=f"paper {label}")
    ax.set(xscale="log", yscale="log", xlabel="classes K", ylabel="MB",
           title=f"ResNet-18 shapes, M = {m}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6)
  fig.tight_layout()
  if path:
    fig.savefig(path, dpi=100)
    plt.close(fig)
  return fig


# The command.

def _uptime() -> str:
  try:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())
  except OSError:
    return "n/a"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sweeps", nargs="+", default=["clients", "params", "classes",
                                                      "memory"],
                      help="what to run (default: clients params classes memory)")
  parser.add_argument("--repeats", type=int, default=5,
                      help="timed runs per function at most; the median is reported")
  parser.add_argument("--budget", type=float, default=45.0,
                      help="seconds of timed repeats per size after which no "
                      "repeat starts (at least one runs)")
  parser.add_argument("--out", default=None,
                      help="output directory (default: benchmarks/results/, a "
                      "temporary directory with --quick)")
  parser.add_argument("--quick", action="store_true",
                      help="tiny sizes, 2 repeats, XLA backend optimisations off: "
                      "a smoke run, its numbers mean nothing")
  args = parser.parse_args()
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  out = args.out or (tempfile.mkdtemp(prefix="pflax-scaling-") if args.quick
                     else str(RESULTS))
  os.makedirs(out, exist_ok=True)
  repeats = 2 if args.quick else args.repeats
  started, load_before = time.perf_counter(), _uptime()
  log = lambda text: print(text, file=sys.stderr, flush=True)

  chosen = [s for s in sweeps(args.quick) if s.axis in args.sweeps]
  timings = time_points([p for s in chosen for p in s.points], repeats, args.budget,
                        log=log)
  sections = []
  for sweep in chosen:
    name = f"scaling_{sweep.axis}.png"
    plot_sweep(sweep, timings, os.path.join(out, name))
    sections.append(f"### Time vs {AXIS_LABELS[sweep.axis]}\n\n"
                    f"ms (ratio to floor)\n\n{sweep_table(sweep, timings)}\n\n"
                    f"![{sweep.axis}]({name})\n")
  if "memory" in args.sweeps:
    rows = memory_rows([20] if args.quick else [20, 100],
                       [10] if args.quick else [10, 100, 1000])
    plot_memory(rows, os.path.join(out, "memory_cwfedavg.png"))
    sections.append("### Peak memory of cwFedAvg (paper Table 7)\n\n"
                    f"{memory_table(rows)}\n\n![memory](memory_cwfedavg.png)\n")

  header = (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: "
            f"jax {jax.__version__} on {jax.devices()[0].platform}, "
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
            f"median of up to {repeats} repeats, none started after "
            f"{args.budget:g} s of timed repeats per size; load average "
            f"(1, 5, 15 min) {load_before} at start, {_uptime()} at end; "
            f"{time.perf_counter() - started:.0f} s in all.\n")
  report = header + "\n" + "\n".join(sections)
  with open(os.path.join(out, "scaling.md"), "w") as f:
    f.write(report)
  print(report)
  log(f"wrote {out}")


if __name__ == "__main__":
  main()
