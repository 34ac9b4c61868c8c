"""benchmarks/gpu.py: its training section runs (tiny) and reports ratios."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu():
  spec = importlib.util.spec_from_file_location("gpu", ROOT / "benchmarks" / "gpu.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _check_rows(gpu, rows, sizes, impls, model_names):
  assert [(r["model"], r["impl"]) for r in rows] == [
      (m, i) for m in model_names for i in impls]
  measured = [r for r in rows if r["round"] is not None]
  assert all(r["round"] > 0 and r["compile"] >= 0 for r in measured)
  assert {r["impl"] for r in rows} - {r["impl"] for r in measured} <= {"torch"}
  table = gpu.training_markdown(rows, sizes.samples)
  for m in model_names:
    assert f"| {m} | 2 | plain vmap |" in table
  assert "| 1.00x |" in table


def test_training_section_runs(gpu):
  # The reference, the candidate trainer and torch (measured or "not installed").
  sizes = gpu.Sizes(quick=True, clients=[2])
  impls = (gpu.BASELINE, "pflax steps", "torch")
  rows = gpu.training_rows(sizes, model_names=("mlp",), impls=impls)
  _check_rows(gpu, rows, sizes, impls, ("mlp",))
  assert gpu.training_impls()[0] == gpu.BASELINE


@pytest.mark.slow
@pytest.mark.extended   # CI runs `benchmarks/gpu.py --quick` itself
def test_quick_training_section_runs_every_implementation(gpu):
  sizes = gpu.Sizes(quick=True, clients=None)
  rows = gpu.training_rows(sizes)
  _check_rows(gpu, rows, sizes, gpu.training_impls(), ("cnn", "mlp"))


def test_missing_leaderboard_script_is_reported(gpu, monkeypatch, tmp_path):
  monkeypatch.setattr(gpu, "ROOT", tmp_path)
  assert gpu.leaderboard_markdown(gpu.Sizes(quick=True, clients=None)) == (
      "leaderboard.py not found: not measured.")


def test_the_leaderboard_section_compares_settings_side_by_side_and_apart(
    gpu, monkeypatch):
  row = lambda algorithm, setting, seconds, sweep: {
      "algorithm": algorithm, "setting": setting, "seconds_per_round": seconds,
      "sweep": sweep}
  both = ["pathological", "dirichlet"]
  together = {"projected_hours": 1.5, "rows": [
      row(a, s, t, both) for a, t in (("fedavg", 0.5), ("ditto", 1.0), ("fedper", 0.7))
      for s in both]}
  apart = {"projected_hours": 9.0, "rows": [
      row("fedavg", "pathological", 0.4, ["pathological"]),
      row("fedavg", "dirichlet", 0.4, ["dirichlet"]),
      row("ditto", "pathological", 0.8, ["pathological"]),
      row("ditto", "dirichlet", 0.8, ["dirichlet"])]}
  calls = []
  monkeypatch.setattr(gpu, "_leaderboard_slice", lambda sizes, extra: calls.append(
      extra) or (apart if extra else together))
  text = gpu.leaderboard_markdown(gpu.Sizes(quick=True, clients=None))
  assert calls == [[], ["--apart", "--algorithms", "fedavg", "ditto"]]
  assert "| ditto | dirichlet | 1.000 |" in text
  assert "Projected whole leaderboard at 2,000 rounds: 1.50 hours." in text
  # Each sweep once: 0.5 + 1.0 side by side, 0.4 * 2 + 0.8 * 2 apart.
  assert text.endswith("1.500 against 2.400 s per round of both (1.60x).")
