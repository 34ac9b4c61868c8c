"""PNG plots of a `results.json`: accuracy curves and output-layer norm heatmaps."""

import os

import numpy as np

from pflax._src import records


def _pyplot():
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


def accuracy_curves(results: records.Results, path: str) -> None:
  """Personalized accuracy per round, mean over seeds, one line per algorithm."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name in dict.fromkeys(r.label for r in results.runs):
    curves = [r.curve() for r in results.runs if r.label == name]
    acc = np.mean([accs for _, accs in curves], axis=0)
    ax.plot(curves[0][0], 100 * acc, label=name)
  ax.set_xlabel("round")
  ax.set_ylabel("personalized accuracy (%)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def norm_heatmaps(results: records.Results, path: str) -> None:
  """Data distribution beside each algorithm's output-layer norms (cwFedAvg Fig. 3)."""
  plt = _pyplot()
  seed = results.runs[0].seed
  runs = [r for r in results.runs if r.seed == seed]
  panels = [("data: samples per class", np.asarray(results.class_counts))]
  panels += [(r.label, np.asarray(r.output_norms)) for r in runs]
  cols = min(3, len(panels))
  rows = -(-len(panels) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.2 * rows), squeeze=False)
  for ax, (title, values) in zip(axes.flat, panels):
    image = ax.imshow(values, aspect="auto", cmap="viridis")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    fig.colorbar(image, ax=ax, fraction=0.046)
  for ax in list(axes.flat)[len(panels):]:
    ax.axis("off")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write_all(results: records.Results, out_dir: str) -> list[str]:
  """Writes every plot into `out_dir`; returns the file names."""
  names = {"accuracy.png": accuracy_curves, "output_norms.png": norm_heatmaps}
  for name, plot in names.items():
    plot(results, os.path.join(out_dir, name))
  return list(names)
