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
