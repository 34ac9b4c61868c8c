"""Plots: an algorithm keeps its colour in every plot and notebook."""

import matplotlib.colors
import numpy as np
import pytest

from pflax import algorithms
from pflax import simulate
from pflax._src import plots


def _run(algorithm, seed=0, hyperparameter=None):
  history = tuple(simulate.RoundRecord(round=t, train_loss=1.0, accuracies={
      "personalized": simulate.Accuracy(0.1 * t, 0.1 * t, 0.0)}) for t in (1, 2))
  return simulate.RunRecord(algorithm=algorithm, seed=seed, history=history,
                            seconds=1.0, output_norms=np.ones((2, 3)),
                            hyperparameter=hyperparameter or {})


def test_pflax_algorithms_have_distinct_fixed_colours():
  colours = [simulate.algorithm_color(name) for name in algorithms.BUILDERS]
  assert len(set(colours)) == len(colours)
  assert all(matplotlib.colors.is_color_like(c) for c in colours)


def test_a_custom_algorithm_has_a_stable_colour():
  assert (simulate.algorithm_color("my_algorithms:ditto")
          == simulate.algorithm_color("my_algorithms:ditto"))


@pytest.mark.parametrize("order", [("fedavg", "fedrema"), ("fedrema", "fedavg")])
def test_accuracy_lines_take_the_algorithms_colour_whatever_the_order(order):
  runs = tuple(_run(name) for name in order) + (_run("fedavg", hyperparameter={"lr": 0.1}),)
  results = simulate.Results({"dataset": "digits", "seeds": [0]}, np.ones((2, 3)), runs)
  fig = plots.accuracy_figure(results)
  lines = fig.axes[0].get_lines()
  assert [line.get_label() for line in lines] == [r.label for r in runs]
  for line, run in zip(lines, runs):
    assert (matplotlib.colors.to_hex(line.get_color())
            == matplotlib.colors.to_hex(simulate.algorithm_color(run.algorithm)))
  plots._pyplot().close(fig)
