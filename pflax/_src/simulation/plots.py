"""Figures of runs: accuracy curves and output-layer norm heatmaps.

`plot_accuracy` and `plot_output_norms` take a `Results` or the `RunRecord`s (or
one) that `pflax.simulate.run` and `sweep` return, and return a pyplot figure, as
`plt.subplots` would: a notebook shows it, `plt.show()` shows it, `fig.savefig`
writes it. `save_plots` writes both as PNGs from figures made without pyplot (no
backend chosen or changed, no window). matplotlib is imported only when a figure is
drawn.
"""

import io
import os
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from pflax._src.methods import registry
from pflax._src.simulation import records

if TYPE_CHECKING:
  from matplotlib.axes import Axes
  from matplotlib.figure import Figure

# Matplotlib's tab10, then darker tones of tab20b/tab20c: 20 distinct colours.
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
            "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939",
            "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354",
            "#756bb1", "#636363")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "p", "h", "d", "8",
            "H", "x", "+", "1", "2", "3")
_LINESTYLES = ("-", "--", ":", "-.")

Runs = records.Results | records.RunRecord | Iterable[records.RunRecord]


def _style_index(algorithm: str, size: int) -> int:
  """pflax's own in the order of `pflax.algorithms.METHODS`, any other name by
  a hash of it."""
  names = tuple(registry.METHODS)
  index = names.index(algorithm) if algorithm in names else zlib.crc32(algorithm.encode())
  return index % size


def algorithm_color(algorithm: str) -> str:
  """An algorithm's colour, the same in every plot: pflax's own in the order of
  `pflax.algorithms.METHODS`, any other name by a hash of it."""
  return _PALETTE[_style_index(algorithm, len(_PALETTE))]


def _marker(algorithm: str) -> str:
  """An algorithm's marker, the same in every plot, as `algorithm_color`."""
  return _MARKERS[_style_index(algorithm, len(_MARKERS))]


def _results(runs: Runs) -> records.Results:
  return runs if isinstance(runs, records.Results) else records.Results.of(runs)


def _pyplot_figure(figsize: tuple[float, float]) -> "Figure":
  """A figure of pyplot's, shown as pyplot's current backend shows figures."""
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt.figure(figsize=figsize, layout="constrained")


def file_figure(figsize: tuple[float, float]) -> "Figure":
  """A figure outside pyplot, to save: it touches no backend and needs no closing."""
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel
  return Figure(figsize=figsize, layout="constrained")


NewFigure = Callable[[tuple[float, float]], "Figure"]


def _title(config: Mapping[str, Any], seeds: Iterable[int]) -> str:
  """`dataset, partition (its parameter), M clients, seeds ...`, of what is known."""
  seeds = list(seeds)
  partition = config.get("partition")
  detail = {"pathological": f"{config.get('classes_per_client')} classes per client",
            "dirichlet": f"Dirichlet alpha {config.get('dirichlet_alpha')}",
            "groups": f"s = {config.get('iid_fraction')}"}.get(partition)
  parts = [config.get("dataset"), partition and (f"{partition} ({detail})" if detail
                                                 else partition),
           "clients" in config and f"{config['clients']} clients",
           f"seed{'s' * (len(seeds) != 1)} {' '.join(map(str, seeds))}"]
  return ", ".join(p for p in parts if p)


def _series(results: records.Results, kind: str) -> list[list[records.RunRecord]]:
  """The runs (one per seed) of each `RunRecord.label` that evaluates `kind`."""
  runs = [r for r in results.runs if r.curve(kind)[0]]
  return [[r for r in runs if r.label == label]
          for label in dict.fromkeys(r.label for r in runs)]


def _curves(runs: list[records.RunRecord], kind: str) -> tuple[list[int], np.ndarray]:
  """The evaluated rounds and a `(seeds, rounds)` array of accuracies in %,
  cut to the shortest run."""
  curves = [r.curve(kind) for r in runs]
  length = min(len(rounds) for rounds, _ in curves)
  return curves[0][0][:length], 100 * np.array([acc[:length] for _, acc in curves])


def _draw(axes: "Axes", i: int, run: records.RunRecord, rounds: list[int],
          acc: np.ndarray, linestyle: Any) -> None:
  """Series `i`: the mean of `acc` over seeds as a line above and thinner than
  series `i - 1`, its markers shifted; the min-max band under every line."""
  color = algorithm_color(run.algorithm)
  if len(acc) > 1:
    axes.fill_between(rounds, acc.min(0), acc.max(0), color=color, alpha=0.15,
                      linewidth=0, zorder=1)
  every = max(1, round(len(rounds) / 10))
  axes.plot(rounds, acc.mean(0), label=run.label, color=color, linestyle=linestyle,
            linewidth=max(0.8, 2.6 - 0.25 * i), marker=_marker(run.algorithm),
            markersize=max(5.0, 7.0 - 0.2 * i), markevery=(i % every, every),
            markeredgecolor="white", markeredgewidth=0.4, zorder=2 + i)


def plot_accuracy(results: Runs, *, kind: str = "personalized",
                  ax: "Axes | None" = None) -> "Figure":
  """Accuracy per round of each algorithm (and swept value): the mean over seeds as
  a line and, with several seeds, their min-max as a shaded band.

  An algorithm keeps its colour (`algorithm_color`) and a marker of its own in
  every plot; a swept value changes the line style. Each series is drawn above
  and thinner than the ones before it, with its markers shifted, and dotted where
  it coincides with an earlier one (within half a percentage point, as FedProx
  with a small mu and FedAvg), so both still show.

  Args:
    results: a `Results`, or the `RunRecord`s of `pflax.simulate.run`/`sweep`.
    kind: the kind of model (`pflax.algorithms.EVALUATED`); runs that do not
      evaluate it are left out.
    ax: the matplotlib `Axes` to draw on; by default a new figure's.

  Returns:
    The figure (`ax`'s, if given).
  """
  return _accuracy(_results(results), kind, ax, _pyplot_figure)


def _accuracy(results: records.Results, kind: str, ax: "Axes | None",
              new_figure: NewFigure) -> "Figure":
  fig = ax.figure if ax is not None else new_figure((8.5, 4.5))
  axes = ax if ax is not None else fig.subplots()
  series = _series(results, kind)
  means: list[np.ndarray] = []
  for i, runs in enumerate(series):
    rounds, acc = _curves(runs, kind)
    mean = acc.mean(0)
    hides = any(m.shape == mean.shape and np.allclose(m, mean, atol=0.5) for m in means)
    means.append(mean)
    value = sum(s[0].algorithm == runs[0].algorithm for s in series[:i])
    _draw(axes, i, runs[0], rounds, acc,
          (0, (1.5, 1.5)) if hides else _LINESTYLES[value % len(_LINESTYLES)])
  seeds = list(dict.fromkeys(r.seed for r in results.runs))
  spread = f"\nline: mean over {len(seeds)} seeds, band: min-max over seeds"
  axes.set_title(_title(results.config, seeds) + spread * (len(seeds) > 1), fontsize=9)
  axes.set_xlabel("round")
  axes.xaxis.get_major_locator().set_params(integer=True)
  axes.set_ylabel(f"{kind} accuracy (%)")
  axes.grid(alpha=0.3)
  outside = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "frameon": False}
  axes.legend(fontsize=8, **(outside if ax is None else {}))
  return fig


def plot_output_norms(results: Runs, *, seed: int | None = None) -> "Figure":
  """Each algorithm's output-layer weight norms per client and class after the last
  round, beside the data distribution (the cwFedAvg paper's Fig. 3).

  Every panel has its own colour scale (its own minimum to maximum, with its own
  colourbar), so each algorithm's class pattern shows whatever its norms' range:
  compare patterns across panels, not colours. The data panel (samples per client
  and class) is left out if `results` has no class counts.

  Args:
    results: a `Results`, or the `RunRecord`s of `pflax.simulate.run`/`sweep`.
    seed: the seed whose runs are shown; by default the first run's.

  Returns:
    The figure.

  Raises:
    ValueError: if there is nothing to show (no class counts, and no run of `seed`
      has output norms).
  """
  return _output_norms(_results(results), seed, _pyplot_figure)


def _output_norms(results: records.Results, seed: int | None,
                  new_figure: NewFigure) -> "Figure":
  seed = results.runs[0].seed if seed is None and results.runs else seed
  panels = [] if results.class_counts is None else [
      ("data", np.asarray(results.class_counts), "samples", 0)]
  panels += [(r.label, np.asarray(r.output_norms), "weight norm", None)
             for r in results.runs if r.seed == seed and np.size(r.output_norms)]
  if not panels:
    raise ValueError(f"plot_output_norms: no run of seed {seed} has output_norms and "
                     "results has no class_counts")
  cols = min(3, len(panels))
  rows = -(-len(panels) // cols)
  fig = new_figure((3.8 * cols, 3.3 * rows + 0.4))
  axes = fig.subplots(rows, cols, squeeze=False)
  for ax, (name, values, label, vmin) in zip(axes.flat, panels):
    image = ax.imshow(values, aspect="auto", cmap="viridis", vmin=vmin,
                      interpolation="nearest")
    ax.set_title(name, fontsize=9)
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    ax.set_yticks(np.arange(0, values.shape[0], max(1, -(-values.shape[0] // 10))))
    ax.set_xticks(np.arange(0, values.shape[1], max(1, -(-values.shape[1] // 10))))
    fig.colorbar(image, ax=ax, fraction=0.046).set_label(label, fontsize=8)
  for ax in list(axes.flat)[len(panels):]:
    ax.axis("off")
  fig.suptitle(f"{_title(results.config, [seed])}\noutput-layer weight norms per "
               "client and class; each panel has its own colour scale", fontsize=9)
  return fig


def save_plots(results: records.Results, out_dir: str) -> list[str]:
  """Writes `accuracy.png` (`plot_accuracy`) and, if there are output norms or
  class counts, `output_norms.png` (`plot_output_norms`) into `out_dir` (made if
  missing); returns their paths."""
  os.makedirs(out_dir, exist_ok=True)
  figures = {"accuracy.png": (lambda: _accuracy(
      results, "personalized", None, file_figure), 120)}
  first = results.runs[0].seed if results.runs else None
  if results.class_counts is not None or any(
      np.size(r.output_norms) for r in results.runs if r.seed == first):
    figures["output_norms.png"] = (lambda: _output_norms(results, None, file_figure),
                                   110)
  paths = []
  for name, (figure, dpi) in figures.items():
    paths.append(os.path.join(out_dir, name))
    save_figure(figure(), paths[-1], dpi)
  return paths


def save_figure(fig: "Figure", path: str, dpi: int) -> None:
  """Writes `fig` as PNG to `path` (`records.write_file`: atomic, no symlink
  followed)."""
  buffer = io.BytesIO()
  fig.savefig(buffer, format="png", dpi=dpi)
  records.write_file(path, buffer.getvalue())
