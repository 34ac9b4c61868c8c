"""PNG plots of a `results.json`: accuracy curves and output-layer norm heatmaps."""

import os
import zlib
from typing import Any

import numpy as np

from pflax._src import builders
from pflax._src import records

_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
            "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def _pyplot():
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


def algorithm_color(algorithm: str) -> str:
  """An algorithm's colour, the same in every plot: pflax's eight in the order of
  `pflax.algorithms.BUILDERS`, any other name by a hash of it."""
  names = tuple(builders.BUILDERS)
  index = names.index(algorithm) if algorithm in names else zlib.crc32(
      algorithm.encode()) % len(_PALETTE)
  return _PALETTE[index % len(_PALETTE)]


def title(config: dict[str, Any]) -> str:
  """`dataset, partition (its parameter), M clients, seeds ...` of a results config."""
  partition = config.get("partition", "?")
  detail = {"pathological": f"{config.get('classes_per_client')} classes per client",
            "dirichlet": f"Dirichlet alpha {config.get('dirichlet_alpha')}",
            "groups": f"s = {config.get('iid_fraction')}"}.get(partition, "")
  seeds = " ".join(map(str, config.get("seeds", [])))
  return (f"{config.get('dataset', '?')}, {partition} ({detail}), "
          f"{config.get('clients', '?')} clients, seeds {seeds or '?'}")


def accuracy_figure(results: records.Results) -> Any:
  """A matplotlib figure of the personalized accuracy per round, mean over seeds,
  one line per algorithm in its colour (`algorithm_color`)."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name in dict.fromkeys(r.label for r in results.runs):
    runs = [r for r in results.runs if r.label == name]
    curves = [r.curve() for r in runs]
    acc = np.mean([accs for _, accs in curves], axis=0)
    style = "-" if not runs[0].hyperparameter else "--"
    ax.plot(curves[0][0], 100 * acc, style, label=name,
            color=algorithm_color(runs[0].algorithm))
  ax.set_title(title(results.config), fontsize=9)
  ax.set_xlabel("round")
  ax.set_ylabel("personalized accuracy (%)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  return fig


def accuracy_curves(results: records.Results, path: str) -> None:
  """Writes `accuracy_figure(results)` as a PNG to `path`."""
  fig = accuracy_figure(results)
  fig.savefig(path, dpi=120)
  _pyplot().close(fig)


def norm_heatmaps(results: records.Results, path: str) -> None:
  """Data distribution beside each algorithm's output-layer norms (cwFedAvg Fig. 3).

  The algorithms' panels share one colour scale, so their norms compare; the data
  panel has its own (samples).
  """
  plt = _pyplot()
  seed = results.runs[0].seed
  runs = [r for r in results.runs if r.seed == seed and np.size(r.output_norms)]
  norms = [np.asarray(r.output_norms) for r in runs]
  high = max((float(n.max()) for n in norms), default=1.0)
  panels = [("data", np.asarray(results.class_counts), "samples", None)]
  panels += [(r.label, n, "output-layer weight norm", high) for r, n in zip(runs, norms)]
  cols = min(3, len(panels))
  rows = -(-len(panels) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(3.8 * cols, 3.3 * rows), squeeze=False)
  for ax, (name, values, label, vmax) in zip(axes.flat, panels):
    image = ax.imshow(values, aspect="auto", cmap="viridis", vmin=0, vmax=vmax)
    ax.set_title(name, fontsize=9)
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    step = max(1, -(-values.shape[0] // 10))
    ax.set_yticks(np.arange(0, values.shape[0], step))
    ax.set_xticks(np.arange(0, values.shape[1], max(1, -(-values.shape[1] // 10))))
    fig.colorbar(image, ax=ax, fraction=0.046).set_label(label, fontsize=8)
  for ax in list(axes.flat)[len(panels):]:
    ax.axis("off")
  fig.suptitle(f"{title(results.config)} (seed {seed})", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write_all(results: records.Results, out_dir: str) -> list[str]:
  """Writes every plot into `out_dir`; returns the file names."""
  names = {"accuracy.png": accuracy_curves, "output_norms.png": norm_heatmaps}
  for name, plot in names.items():
    plot(results, os.path.join(out_dir, name))
  return list(names)
