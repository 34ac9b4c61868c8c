"""benchmarks/leaderboard.py: PFLlib's Fashion-MNIST leaderboard, at a tiny size."""

import importlib.util
import json
import os
import pathlib

import pytest

from pflax._src.data import datasets

pytestmark = pytest.mark.skipif(
    not os.path.isdir(datasets.DEBIAN_FASHION_MNIST),
    reason=f"Fashion-MNIST is not installed in {datasets.DEBIAN_FASHION_MNIST}")

_SCRIPT = pathlib.Path(__file__).parent.parent / "benchmarks" / "leaderboard.py"


def _leaderboard():
  spec = importlib.util.spec_from_file_location("leaderboard", _SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.slow
def test_one_command_runs_both_settings_and_writes_the_table(tmp_path):
  board = _leaderboard()
  out, report = tmp_path / "table.md", tmp_path / "slice.json"
  board.main(["--slice", "--quick", "--rounds", "3", "--samples-per-client", "20",
              "--algorithms", "fedavg", "fedper", "--json", str(report),
              "--out", str(out)])
  rows = json.loads(report.read_text())["rows"]
  assert [(r["algorithm"], r["setting"]) for r in rows] == [
      ("fedavg", "pathological"), ("fedper", "pathological"),
      ("fedavg", "dirichlet"), ("fedper", "dirichlet")]
  for row in rows:
    assert row["seeds"] == 3 and row["rounds"] == 3 and row["seconds_per_round"] > 0
    assert 0.0 <= row["accuracy_mean"] <= 100.0
  projected = json.loads(report.read_text())["projected_hours"]
  assert projected == pytest.approx(
      sum(r["seconds_per_round"] for r in rows) * 2000 / 3600)
  table = out.read_text()
  assert "| fedper | dirichlet | 3 |" in table and "| 97.44 |" in table
