"""Plots: an algorithm keeps its colour in every plot and notebook, several seeds show
their spread, overlapping curves stay visible, each norm panel has its own scale."""

import os
import subprocess
import sys

import matplotlib.colors
import matplotlib.figure
import matplotlib.pyplot as plt
import numpy as np
import pytest

from pflax import algorithms
from pflax import simulate


def _run(algorithm, seed=0, hyperparameter=None, accuracies=(0.1, 0.2), norms=None):
  history = tuple(simulate.RoundRecord(round=t, train_loss=1.0, accuracies={
      "personalized": simulate.Accuracy(a, a, 0.0)})
                  for t, a in enumerate(accuracies, start=1))
  return simulate.RunRecord(algorithm=algorithm, seed=seed, history=history,
                            seconds=1.0,
                            output_norms=np.ones((2, 3)) if norms is None else norms,
                            hyperparameter=hyperparameter or {})


@pytest.fixture(autouse=True)
def _close_figures():
  yield
  plt.close("all")


def _hex(color):
  return matplotlib.colors.to_hex(color)


def test_pflax_algorithms_have_distinct_fixed_colours():
  colours = [simulate.algorithm_color(name) for name in algorithms.METHODS]
  assert len(set(colours)) == len(colours)
  assert all(matplotlib.colors.is_color_like(c) for c in colours)


def test_a_custom_algorithm_has_a_stable_colour():
  assert (simulate.algorithm_color("my_algorithms:ditto")
          == simulate.algorithm_color("my_algorithms:ditto"))


@pytest.mark.parametrize("order", [("fedavg", "fedrema"), ("fedrema", "fedavg")])
def test_accuracy_lines_take_the_algorithms_colour_whatever_the_order(order):
  runs = tuple(_run(name) for name in order) + (_run("fedavg", hyperparameter={"lr": 0.1}),)
  results = simulate.Results({"dataset": "digits", "seeds": [0]}, np.ones((2, 3)), runs)
  fig = simulate.plot_accuracy(results)
  assert isinstance(fig, matplotlib.figure.Figure)
  assert plt.fignum_exists(fig.number)  # pyplot's, as plt.subplots' would be
  lines = fig.axes[0].get_lines()
  assert [line.get_label() for line in lines] == [r.label for r in runs]
  for line, run in zip(lines, runs):
    assert _hex(line.get_color()) == _hex(simulate.algorithm_color(run.algorithm))


def test_several_seeds_draw_the_mean_and_a_min_max_band_per_algorithm():
  runs = [_run(name, seed, accuracies=(0.1 + 0.1 * seed + offset, 0.5 + offset))
          for name, offset in (("fedavg", 0.0), ("cwfedavg", 0.3)) for seed in (0, 1, 2)]
  ax = simulate.plot_accuracy(runs).axes[0]
  assert len(ax.get_lines()) == 2
  assert len(ax.collections) == 2
  for band, line, offset in zip(ax.collections, ax.get_lines(), (0.0, 0.3)):
    assert _hex(band.get_facecolor()[0][:3]) == _hex(line.get_color())
    low, high = np.sort(np.unique(band.get_paths()[0].vertices[:, 1]))[[0, -1]]
    assert (low, high) == pytest.approx((100 * (0.1 + offset), 100 * (0.5 + offset)))
    np.testing.assert_allclose(line.get_ydata(), 100 * np.array([0.2 + offset,
                                                                 0.5 + offset]))
  assert "min-max" in ax.get_title() and "3 seeds" in ax.get_title()


def test_one_seed_draws_no_band():
  ax = simulate.plot_accuracy([_run("fedavg"), _run("local")]).axes[0]
  assert not ax.collections
  assert "band" not in ax.get_title()


def test_algorithms_have_distinct_markers_and_swept_values_distinct_line_styles():
  runs = [_run(name, accuracies=(0.1 * i, 0.1 * i + 0.05))
          for i, name in enumerate(algorithms.METHODS)]
  lines = simulate.plot_accuracy(runs).axes[0].get_lines()
  assert len({line.get_marker() for line in lines}) == len(algorithms.METHODS)
  swept = [_run("fedprox", hyperparameter={"mu": mu}, accuracies=(mu, 2 * mu))
           for mu in (0.1, 0.2, 0.3)]
  lines = simulate.plot_accuracy(swept).axes[0].get_lines()
  assert len({line.get_marker() for line in lines}) == 1
  assert len({line.get_linestyle() for line in lines}) == 3


def test_an_identical_curve_drawn_later_leaves_the_first_visible():
  # FedProx with a small mu equals FedAvg: drawn on top, it is thinner and dotted.
  under, over = simulate.plot_accuracy([_run("fedavg"), _run("fedprox")]).axes[0].get_lines()
  np.testing.assert_array_equal(under.get_ydata(), over.get_ydata())
  assert over.get_zorder() > under.get_zorder()
  assert over.get_linewidth() < under.get_linewidth()
  assert under.get_linestyle() == "-" and over.get_linestyle() != "-"
  assert over.get_marker() != under.get_marker()


def test_long_runs_space_their_markers_and_shift_each_series():
  runs = [_run(name, accuracies=np.linspace(0.1, 0.9, 40) + 0.01 * i)
          for i, name in enumerate(("fedavg", "fedprox"))]
  lines = simulate.plot_accuracy(runs).axes[0].get_lines()
  assert [line.get_markevery() for line in lines] == [(0, 4), (1, 4)]


def test_accuracy_draws_on_a_given_axes():
  fig = matplotlib.figure.Figure()
  ax = fig.subplots()
  assert simulate.plot_accuracy([_run("fedavg")], ax=ax) is fig
  assert len(ax.get_lines()) == 1


def test_each_norm_panel_has_its_own_colour_scale():
  # FedClassAvg's norms (about 7) would make cwFedAvg's (0.01-0.97) one colour.
  cw = np.array([[0.01, 0.5, 0.97], [0.97, 0.2, 0.01]])
  fca = np.array([[6.6, 6.8, 7.0], [7.0, 6.7, 6.6]])
  results = simulate.Results({"dataset": "digits"}, np.array([[5, 0, 1], [0, 3, 4]]),
                             (_run("cwfedavg", norms=cw), _run("fedclassavg", norms=fca)))
  fig = simulate.plot_output_norms(results)
  panels = [ax for ax in fig.axes if ax.get_images()]
  assert [ax.get_title() for ax in panels] == ["data", "cwfedavg", "fedclassavg"]
  limits = [ax.get_images()[0].get_clim() for ax in panels]
  assert limits == [(0, 5), (0.01, 0.97), (6.6, 7.0)]
  assert len(fig.axes) - len(panels) >= 3  # a colourbar per panel (and unused cells)
  assert "each panel has its own colour scale" in fig.get_suptitle()


def test_norms_of_runs_without_class_counts_have_no_data_panel():
  fig = simulate.plot_output_norms([_run("fedavg"), _run("local"), _run("local", seed=1)])
  titles = [ax.get_title() for ax in fig.axes if ax.get_images()]
  assert titles == ["fedavg", "local"]  # the first run's seed
  assert "seed 0" in fig.get_suptitle()


def test_norms_with_nothing_to_show_is_an_error():
  with pytest.raises(ValueError, match="output_norms"):
    simulate.plot_output_norms([_run("fedavg", norms=np.zeros((0,)))])


def test_results_of_runs_plot_to_pngs(tmp_path):
  paths = simulate.save_plots(
      simulate.Results.of([_run("fedavg"), _run("fedavg", seed=1)]), str(tmp_path / "plots"))
  assert paths == [str(tmp_path / "plots" / name)
                   for name in ("accuracy.png", "output_norms.png")]
  assert all(os.path.getsize(p) > 0 for p in paths)
  assert not plt.get_fignums()  # nothing left open, nothing shown


def test_results_without_norms_write_only_the_accuracy_plot(tmp_path):
  paths = simulate.save_plots(
      simulate.Results.of([_run("fedavg", norms=np.zeros((0,)))]), str(tmp_path))
  assert paths == [str(tmp_path / "accuracy.png")]


def test_importing_pflax_simulate_does_not_import_matplotlib():
  script = "import sys, pflax.simulate; print('matplotlib' in sys.modules)"
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       check=True)
  assert out.stdout.strip() == "False"
