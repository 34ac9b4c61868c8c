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


def test_runs_section_compares_both_layouts_with_one_run_of_all_clients(gpu):
  assert gpu.runs_cases(3, 20) == [("one client axis", 3, 20, True),
                                   ("a client axis per run", 3, 20, False),
                                   ("one run", 1, 60, True)]
  rows = [{"layout": layout, "runs": s, "M": m, "round": seconds, "compile": 1.0}
          for (layout, s, m, _), seconds in zip(gpu.runs_cases(3, 20), (0.5, 0.6, 0.4))]
  table = gpu.runs_markdown(rows).splitlines()
  assert table[2:] == ["| one client axis | 3 x 20 | 0.5000 | 1.25x | 1.0 |",
                       "| a client axis per run | 3 x 20 | 0.6000 | 1.50x | 1.0 |",
                       "| one run | 1 x 60 | 0.4000 | 1.00x | 1.0 |"]


@pytest.mark.parametrize("backend", ["gpu", "cpu"])
def test_main_job_is_run_cold_without_autotuning_on_a_gpu_only(gpu, monkeypatch, backend):
  calls = []
  monkeypatch.setattr(gpu, "_pflax_run", lambda args, env: calls.append((args, env)) or
                      float(len(calls)))
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
  sizes = gpu.Sizes(quick=True, clients=None)
  seconds = gpu.main_job_seconds(sizes, backend)
  table = gpu.main_job_markdown(sizes, seconds)
  if backend == "cpu":
    assert seconds == {"cold": 1.0, "filling": 2.0, "warm": 3.0}
    assert "autotuning" not in table
    return
  assert seconds["cold, no autotuning"] == 4.0
  args, env = calls[-1]
  assert "--no-compilation-cache" in args
  assert env == {"XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_gpu_autotune_level=0"}
  assert table.splitlines()[-1].endswith("autotuning off (`XLA_FLAGS="
                                         "--xla_gpu_autotune_level=0`; the candidate) | 4.0 |")


def test_missing_leaderboard_script_is_reported(gpu, monkeypatch, tmp_path):
  monkeypatch.setattr(gpu, "ROOT", tmp_path)
  sizes = gpu.Sizes(quick=True, clients=None)
  assert gpu.leaderboard_markdown(sizes, gpu._leaderboard_slice(sizes, [])) == (
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
  monkeypatch.setattr(gpu, "_leaderboard_slice",
                      lambda sizes, extra: calls.append(extra) or apart)
  text = gpu.leaderboard_markdown(gpu.Sizes(quick=True, clients=None), together)
  assert calls == [["--apart", "--algorithms", "fedavg", "ditto"]]
  assert "| ditto | dirichlet | 1.000 |" in text
  assert "Projected whole leaderboard at 2,000 rounds: 1.50 hours." in text
  # Each sweep once: 0.5 + 1.0 side by side, 0.4 * 2 + 0.8 * 2 apart.
  assert text.endswith("1.500 against 2.400 s per round of both (1.60x).")


def _rounds(gpu, slowdown, fall=1.0):
  """Training rows at every target M: the plain vmap's round 1 s per 100 clients,
  pflax's `slowdown` times it, and at M = 1,000 its round `fall` times longer."""
  rows = []
  for model_name in ("cnn", "mlp"):
    for m in gpu.TARGET_CLIENTS:
      base = m / 100
      rows.append({"model": model_name, "M": m, "impl": gpu.BASELINE, "round": base})
      ours = base * slowdown * (fall if m == 1000 else 1.0)
      rows += [{"model": model_name, "M": m, "impl": impl, "round": ours}
               for impl in ("pflax vmap", "pflax steps")]
  return rows


def _verdicts(text):
  """`{target cell: verdict cell}` of the targets table."""
  cells = [line.split(" | ") for line in text.splitlines()[2:]]
  return {c[0].lstrip("| "): c[-1].rstrip(" |") for c in cells}


def test_targets_on_a_gpu_are_judged_from_the_measured_numbers(gpu):
  fast = {"cold": 20.0, "filling": 24.0, "warm": 9.0}
  verdicts = _verdicts(gpu.targets_markdown("gpu", 16, _rounds(gpu, 1.05), fast, 1.9))
  assert len(verdicts) == 7
  assert sorted(set(verdicts.values())) == ["met", "unmeasured"]
  assert [t for t, v in verdicts.items() if v == "unmeasured"] == [
      "the main job cold in 35 s at most (two CPU cores)"]
  slow = {"cold": 20.0, "filling": 26.0, "warm": 9.0}
  text = gpu.targets_markdown("gpu", 16, _rounds(gpu, 1.2, fall=1.2), slow, 2.5)
  assert "cnn 20: 1.20x" in text and "mlp: 0.83x" in text
  assert list(_verdicts(text).values()).count("**not met**") == 6


def test_gpu_targets_are_unmeasured_on_a_cpu_and_the_cpu_target_judged(gpu):
  job = {"cold": 34.0, "filling": 36.0, "warm": 20.0}
  verdicts = _verdicts(gpu.targets_markdown("cpu", 2, _rounds(gpu, 1.0), job, 0.5))
  assert list(verdicts.values()) == ["unmeasured"] * 4 + ["**not met**"]
  job["filling"] = 33.0
  text = gpu.targets_markdown("cpu", 2, None, job, None)
  assert "no GPU: this run is on `cpu`" in text
  assert _verdicts(text)["the main job cold in 35 s at most (two CPU cores)"] == "met"
  # Measured on more cores than the target's two: not judged.
  eight = gpu.targets_markdown("cpu", 8, None, job, None)
  assert "(on 8 cores, not 2)" in eight
  assert set(_verdicts(eight).values()) == {"unmeasured"}


def test_trainer_targets_need_every_m(gpu):
  rows = [r for r in _rounds(gpu, 1.0) if r["M"] != 1000]
  text = gpu.targets_markdown("gpu", 16, rows, None, None)
  assert "not every M of (20, 100, 1000) measured" in text
  assert set(_verdicts(text).values()) == {"unmeasured"}
