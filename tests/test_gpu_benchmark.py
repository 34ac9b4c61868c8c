"""benchmarks/gpu.py: its training section runs (tiny) and reports ratios; its
time budget stops what it has no time for; benchmarks/gpu_device.sh runs it."""

import importlib.util
import os
import pathlib
import subprocess
import sys
import textwrap

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
  monkeypatch.setattr(gpu, "_pflax_run", lambda args, env, timeout: calls.append(
      (args, env)) or float(len(calls)))
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
  for r in together["rows"]:
    r.update(accuracy_mean=80.0, accuracy_std=1.0)
  bf16 = {"projected_hours": 1.0, "rows": [
      {**row(a, s, 0.4, both), "accuracy_mean": 79.5, "accuracy_std": 2.0,
       "rounds": 10, "seeds": 3} for a in ("fedavg", "ditto") for s in both]}
  calls = []
  monkeypatch.setattr(gpu, "_leaderboard_slice", lambda sizes, extra, budget: calls.append(
      extra) or (apart if "--apart" in extra else bf16))
  text = gpu.leaderboard_markdown(gpu.Sizes(quick=True, clients=None), together)
  assert calls == [["--apart", "--algorithms", "fedavg", "ditto"],
                   ["--precision", "bf16", "--algorithms", "fedavg", "ditto"]]
  assert "| ditto | dirichlet | 1.000 |" in text
  assert "Projected whole leaderboard at 2,000 rounds: 1.50 hours." in text
  # Each sweep once: 0.5 + 1.0 side by side, 0.4 * 2 + 0.8 * 2 apart.
  assert "1.500 against 2.400 s per round of both (1.60x)." in text
  assert "`--precision bf16` against float32, 10 rounds, 3 seeds" in text
  assert text.endswith("| ditto | dirichlet | 80.00 ± 1.00 | 79.50 ± 2.00 | 1.000 | 0.400 |")


def test_an_interrupted_slice_is_shown_without_a_projection_or_comparisons(
    gpu, monkeypatch):
  cut = {"projected_hours": None, "interrupted": True, "rows": [
      {"algorithm": "fedavg", "setting": "pathological", "seconds_per_round": 0.5}]}
  monkeypatch.setattr(gpu, "_leaderboard_slice", lambda *args: pytest.fail("ran"))
  text = gpu.leaderboard_markdown(gpu.Sizes(quick=True, clients=None), cut)
  assert text.endswith("| fedavg | pathological | 0.500 |\n\nNot projected: interrupted "
                       "when the time budget was spent, after 1 rows.")


def test_the_slice_runs_the_sections_rounds_on_the_data_given(gpu):
  sizes = gpu.Sizes(quick=False, clients=None, leaderboard_rounds=12, data_dir="/d")
  assert gpu._slice_flags(sizes) == ["--rounds", "12", "--eval-every", "12",
                                     "--data-dir", "/d"]
  assert gpu._slice_flags(gpu.Sizes(quick=True, clients=None)) == ["--quick"]


def _fake_leaderboard_script(root, seconds):
  """A `benchmarks/leaderboard.py` under `root` that writes one row to --json,
  then sleeps `seconds` and writes it as whole, or on SIGINT as interrupted."""
  script = root / "benchmarks" / "leaderboard.py"
  script.parent.mkdir(parents=True)
  script.write_text(textwrap.dedent(f"""
      import json, signal, sys, time
      signal.signal(signal.SIGINT, signal.default_int_handler)
      path = sys.argv[sys.argv.index("--json") + 1]
      row = {{"algorithm": "fedavg", "setting": "pathological", "seconds_per_round": 0.5}}
      def write(interrupted):
        with open(path, "w") as f:
          json.dump({{"rows": [row], "interrupted": interrupted,
                     "projected_hours": None if interrupted else 1.0}}, f)
      try:
        time.sleep({seconds})
      except KeyboardInterrupt:
        write(True)
        raise
      write(False)
      """))


def test_a_slice_past_the_budget_is_interrupted_and_keeps_its_rows(
    gpu, monkeypatch, tmp_path):
  _fake_leaderboard_script(tmp_path, seconds=60)
  monkeypatch.setattr(gpu, "ROOT", tmp_path)
  sizes = gpu.Sizes(quick=True, clients=None)
  result = gpu._leaderboard_slice(sizes, [], gpu.Budget(1.0))
  assert result["interrupted"] and len(result["rows"]) == 1
  assert gpu._leaderboard_slice(sizes, [], gpu.Budget(0.0)) == f"{gpu.NOT_RUN}."


def test_a_slice_within_the_budget_is_whole(gpu, monkeypatch, tmp_path):
  _fake_leaderboard_script(tmp_path, seconds=0)
  monkeypatch.setattr(gpu, "ROOT", tmp_path)
  result = gpu._leaderboard_slice(gpu.Sizes(quick=True, clients=None), [],
                                  gpu.Budget(60.0))
  assert not result["interrupted"] and result["projected_hours"] == 1.0


def test_a_spent_budget_runs_nothing_and_says_so(gpu, monkeypatch):
  spent, sizes = gpu.Budget(0.0), gpu.Sizes(quick=True, clients=None)
  monkeypatch.setattr(gpu, "_pflax_run", lambda *args: pytest.fail("ran"))
  monkeypatch.setattr(gpu, "jax_round", lambda *args: pytest.fail("ran"))
  rows = gpu.training_rows(sizes, model_names=("mlp",), impls=(gpu.BASELINE,),
                           budget=spent)
  assert rows == [{"model": "mlp", "M": 2, "impl": gpu.BASELINE, "round": None,
                   "note": gpu.NOT_RUN}]
  assert f"| mlp | 2 | plain vmap | {gpu.NOT_RUN} |" in gpu.training_markdown(rows, 8)
  seconds = gpu.main_job_seconds(sizes, "gpu", spent)
  assert seconds == dict.fromkeys(["cold", "filling", "warm", "cold, no autotuning"])
  assert "the time budget was spent" in gpu.main_job_markdown(sizes, seconds)
  job = _verdicts(gpu.targets_markdown("gpu", 16, None, seconds, None))
  assert job["the main job cold in 25 s at most (a GPU)"] == "unmeasured"
  assert gpu.aggregator_markdown(sizes, spent).endswith(f"| all | 4 | {gpu.NOT_RUN} | |")
  runs = gpu.runs_rows(sizes, spent)
  assert [r["round"] for r in runs] == [None] * 3
  assert gpu.runs_markdown(runs).count(gpu.NOT_RUN) == 3
  assert gpu.Budget().left() is None and not gpu.Budget().spent()


def test_the_report_follows_the_sections_order_and_is_written_after_each(
    gpu, monkeypatch):
  monkeypatch.setattr(gpu, "main_job_seconds", lambda sizes, budget: {
      "cold": 1.0, "filling": 2.0, "warm": 0.5})
  monkeypatch.setattr(gpu, "runs_rows", lambda sizes, budget: [
      {"layout": "one run", "runs": 1, "M": 4, "round": 0.1, "compile": 1.0}])
  written = []
  text = gpu.report(gpu.Sizes(quick=True, clients=None), ("runs", "main"),
                    budget=gpu.Budget(600.0), write=written.append)
  titles = [line for line in text.splitlines() if line.startswith("## ")]
  assert titles == ["## A sweep's runs side by side", "## The main job",
                    "## Issue 30's targets"]
  assert len(written) == 3 and written[-1] == text
  assert "## A sweep's runs" in written[0] and "## The main job" not in written[0]
  assert text.rstrip().endswith("within a budget of 600 s.")


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


@pytest.mark.slow  # about 90 s: three pflax-run processes and six compilations
def test_the_device_script_writes_every_file_into_out(tmp_path):
  out = tmp_path / "out"
  env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable,
         "TRAINER_HLO_CLIENTS": "2", "GPU_BUDGET": "400"}
  subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_device.sh"), "--quick",
                  "--sections", "main"], env=env, check=True, timeout=600)
  assert sorted(p.name for p in out.iterdir()) == [
      "gpu.md", "gpu_device.log", "hlo.tgz", "trainer_hlo.md", "trainer_hlo_rounds.md"]
  assert "## The main job" in (out / "gpu.md").read_text()
  assert "| cnn | 2 | plain vmap |" in (out / "trainer_hlo.md").read_text()
  assert "| ditto round | 20 |" in (out / "trainer_hlo_rounds.md").read_text()
  log = (out / "gpu_device.log").read_text()
  assert "gpu.py: exit 0" in log and "trainer_hlo.py --round: exit 0" in log
