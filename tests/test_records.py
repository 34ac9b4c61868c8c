"""Records: what a run's summary says (best, final, last) and results.json round trips."""

import json

import numpy as np
import pytest

from pflax import simulate
from pflax._src.simulation import records


def _history(accuracies, evaluated=None):
  """Rounds 1.. with personalized accuracy `a` (per client mean `a / 2`, std
  `a / 4`) in the rounds listed in `evaluated` (default: all)."""
  evaluated = range(1, len(accuracies) + 1) if evaluated is None else evaluated
  return tuple(simulate.RoundRecord(t, 1.0, accuracies={
      "personalized": simulate.Accuracy(a, a / 2, a / 4)} if t in evaluated else {})
               for t, a in enumerate(accuracies, start=1))


def _run(accuracies, seed=0, evaluated=None, algorithm="fedavg"):
  return simulate.RunRecord(algorithm, seed, _history(accuracies, evaluated), 1.0,
                            np.ones((2, 3)))


def test_last_is_the_last_evaluated_round():
  # Round 4 is not evaluated: the last evaluation is round 3's.
  summary = _run([0.2, 0.9, 0.6, 0.1], evaluated=(1, 2, 3)).summary()
  assert summary.last == 0.6
  assert summary.best == 0.9


@pytest.mark.parametrize("evaluations", [1, 3, records.FINAL_WINDOW, 7])
def test_final_averages_the_last_window_of_evaluations(evaluations):
  accuracies = np.random.default_rng(evaluations).uniform(size=evaluations).tolist()
  summary = _run(accuracies).summary()
  window = accuracies[-min(records.FINAL_WINDOW, evaluations):]
  assert summary.final_window == len(window)
  assert summary.final == pytest.approx(np.mean(window))
  assert summary.client_mean == pytest.approx(np.mean(window) / 2)
  assert summary.client_std == pytest.approx(np.mean(window) / 4)
  assert summary.last == accuracies[-1]
  assert summary.best == max(accuracies)


def test_a_five_round_run_reports_its_last_round_beside_the_mean():
  summary = _run([0.3, 0.6, 0.7, 0.8, 0.86]).summary()
  assert summary.final == pytest.approx(0.652)
  assert summary.last == 0.86


def test_summary_is_none_for_a_kind_never_evaluated():
  assert _run([0.5]).summary("global") is None


def test_results_json_round_trips_with_last_and_final_window(tmp_path):
  results = simulate.Results({"clients": 2}, np.ones((2, 3), int),
                             (_run([0.1, 0.5, 0.4]), _run([0.2, 0.3], seed=1)))
  path = str(tmp_path / "results.json")
  results.save(path)
  with open(path, encoding="utf-8") as f:
    written = json.load(f)["runs"][0]["personalized_accuracy"]
  assert written["last"] == 0.4
  assert written["final_window"] == 3
  assert written["final"] == pytest.approx(1.0 / 3)
  loaded = simulate.Results.load(path)
  assert loaded.to_json() == results.to_json()
  assert loaded.runs[1].summary() == results.runs[1].summary()


def test_an_older_results_json_without_last_reads_the_same(tmp_path):
  # Written before `last` and `final_window` existed: summaries come from history.
  d = simulate.Results({}, np.ones((2, 3), int), (_run([0.1, 0.5, 0.4]),)).to_json()
  for run in d["runs"]:
    run["personalized_accuracy"] = {k: run["personalized_accuracy"][k]
                                    for k in ("best", "final", "client_mean",
                                              "client_std")}
  (tmp_path / "results.json").write_text(json.dumps(d), encoding="utf-8")
  summary = simulate.Results.load(str(tmp_path / "results.json")).runs[0].summary()
  assert (summary.last, summary.final_window) == (0.4, 3)


def test_results_of_runs_without_config_or_class_counts():
  run = _run([0.5, 0.7])
  results = simulate.Results.of([run, _run([0.6, 0.8], seed=1)])
  assert results.config == {} and results.class_counts is None
  assert simulate.Results.of(run).runs == (run,)
  d = json.loads(json.dumps(results.to_json()))
  assert d["class_counts"] is None
  loaded = simulate.Results.from_json(d)
  assert loaded.class_counts is None
  assert loaded.to_json() == results.to_json()


def _cells(row):
  return [c.strip() for c in row.strip("|").split("|")]


def test_table_has_a_last_column_and_says_what_final_averages():
  runs = [_run([0.2, 0.4, 0.6]), _run([0.2, 0.4, 0.8], seed=1)]
  lines = simulate.Results.of(runs).table().splitlines()
  header = _cells(lines[0])
  row = dict(zip(header, _cells(lines[2])))
  assert row["personalized last"] == "70.00 ± 10.00"
  assert row["personalized final"] == "43.33 ± 3.33"
  assert row["personalized best"] == "70.00 ± 10.00"
  assert row["algorithm"] == "fedavg"
  assert "final = mean of the last 3 evaluations" in lines[-1]
  assert "2 seeds" in lines[-1]


def test_table_caption_names_the_range_of_windows():
  runs = [_run([0.5] * 7), _run([0.5, 0.5], algorithm="local")]
  caption = simulate.Results.of(runs).table().splitlines()[-1]
  assert "final = mean of the last 2 to 5 evaluations" in caption


def test_table_of_one_seed_shows_accuracies_without_a_spread():
  lines = simulate.Results.of([_run([0.25, 0.5])]).table().splitlines()
  assert _cells(lines[2])[:4] == ["fedavg", "50.00", "37.50", "50.00"]
  assert "one seed" in lines[-1]


def test_table_caption_of_runs_evaluated_once():
  caption = simulate.Results.of([_run([0.5])]).table().splitlines()[-1]
  assert "final = mean of the last evaluation," in caption
