"""PFLlib's Fashion-MNIST leaderboard: `pflax-run --leaderboard pfllib-fmnist` and
benchmarks/leaderboard.py, at a tiny size."""

import argparse
import dataclasses
import importlib.util
import json
import os
import pathlib
import types

import pytest

from pflax._src.cli import leaderboard
from pflax._src.cli import main as cli
from pflax._src.cli import presets
from pflax._src.cli import runs
from pflax._src.data import datasets
from pflax._src.simulation import simulate

needs_fashion_mnist = pytest.mark.skipif(
    not os.path.isdir(datasets.DEBIAN_FASHION_MNIST),
    reason=f"Fashion-MNIST is not installed in {datasets.DEBIAN_FASHION_MNIST}")

_SCRIPT = pathlib.Path(__file__).parent.parent / "benchmarks" / "leaderboard.py"
BOARD = ["--leaderboard", "pfllib-fmnist"]
TINY = ["--rounds", "2", "--eval-every", "2", "--samples-per-client", "20",
        "--clients", "4", "--model", "mlp", "--seeds", "0", "1", "--algorithms",
        "fedavg", "fedper", "--no-progress", "--no-compilation-cache"]
"""Both settings, two algorithms, two seeds, on a CPU in seconds."""


def _script():
  spec = importlib.util.spec_from_file_location("leaderboard_script", _SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _configs(capsys, *flags):
  assert cli.main([*BOARD, "--print-config", *flags]) == 0
  return json.loads(capsys.readouterr().out)


def test_the_leaderboard_runs_its_presets_with_the_papers_sizes(capsys):
  configs = _configs(capsys)
  assert list(configs) == ["pathological", "dirichlet"]
  for setting, config in configs.items():
    preset = presets.get(f"pfllib-fmnist-{setting}")
    assert config["preset"] == preset.name and config["partition"] == setting
    assert {k: config[k] for k in preset.config} == dict(preset.config)
    assert config["algorithms"] == list(preset.algorithms)
    assert config["rounds"] == 2000 and config["seeds"] == [0, 1, 2]


def test_flags_given_override_every_setting(capsys):
  configs = _configs(capsys, "--rounds", "5", "--eval-every", "5", "--seeds", "7",
                     "--algorithms", "fedavg", "--set", "lr=0.01")
  for setting, config in configs.items():
    assert (config["rounds"], config["eval_every"], config["seeds"]) == (5, 5, [7])
    assert config["algorithms"] == ["fedavg"] and config["partition"] == setting
    assert config["optimizers"]["fedavg"]["lr"] == 0.01


_REFUSED = "--leaderboard runs its presets, .*; it cannot be combined with "


@pytest.mark.parametrize("flags,message", [
    (["--leaderboard", "nope"],
     "--leaderboard: unknown leaderboard 'nope'; leaderboards: pfllib-fmnist$"),
    ([*BOARD, "--preset", "pfllib-fmnist-dirichlet"], _REFUSED + "--preset$"),
    ([*BOARD, "--sweep", "lr", "--values", "0.1"], _REFUSED + "--sweep$"),
    ([*BOARD, "--tune", "lr"], _REFUSED + "--tune$"),
    ([*BOARD, "--flower"], _REFUSED + "--flower$"),
    ([*BOARD, "--resume"], _REFUSED + "--resume$"),
    ([*BOARD, "--rounds", "0"], "--rounds must be >= 1, got 0"),
])
def test_bad_leaderboard_flags_are_one_line_errors(flags, message, tmp_path):
  with pytest.raises(SystemExit, match="^pflax-run: " + message) as error:
    cli.main([*flags, "--out", str(tmp_path / "out")])
  assert "\n" not in str(error.value)
  assert not (tmp_path / "out").exists()


def test_list_presets_lists_the_leaderboard(capsys):
  assert cli.main(["--list-presets"]) == 0
  assert ("--leaderboard pfllib-fmnist\n  presets: pfllib-fmnist-pathological "
          "pfllib-fmnist-dirichlet\n  seeds: 0 1 2") in capsys.readouterr().out


def _sweeps_then_ctrl_c(sweeps):
  """A `timed_sweep` that gives each setting of its sweep two seeds of best
  accuracy 0.5 and 0.25 s per round, `sweeps` times, then is interrupted."""
  done = types.SimpleNamespace(summary=lambda: types.SimpleNamespace(best=0.5))

  def timed_sweep(algorithm, invocations_, setups, label):
    del algorithm, setups, label
    if not sweeps:
      raise KeyboardInterrupt
    sweeps.pop()
    return {setting: [done, done] for setting in invocations_}, 0.25
  return timed_sweep


@pytest.mark.parametrize("dirichlet_lr,rows,sweep", [
    # The settings side by side: the first sweep is FedAvg in both.
    (None, [("fedavg", "pathological"), ("fedavg", "dirichlet")],
     ["pathological", "dirichlet"]),
    # Another lr in one setting: one after the other, as before.
    (0.01, [("fedavg", "pathological")], ["pathological"]),
])
def test_ctrl_c_writes_the_finished_rows(monkeypatch, tmp_path, capsys, dirichlet_lr,
                                         rows, sweep):
  if dirichlet_lr:
    real = leaderboard.invocations
    monkeypatch.setattr(leaderboard, "invocations", lambda *args: {
        s: dataclasses.replace(i, config=dataclasses.replace(i.config,
                                                             lr=dirichlet_lr))
        if s == "dirichlet" else i for s, i in real(*args).items()})
  monkeypatch.setattr(runs, "prepare", lambda invocation: {})
  monkeypatch.setattr(leaderboard, "timed_sweep", _sweeps_then_ctrl_c([()]))
  assert cli.main([*BOARD, "--no-progress", "--out", str(tmp_path)]) == 130
  assert (tmp_path / "leaderboard.md").read_text().splitlines()[2] == (
      "| fedavg | pathological | 2000 | 2 | 50.00 ± 0.00 | 80.41 | 0.250 |")
  written = json.loads((tmp_path / "leaderboard.json").read_text())["rows"]
  assert [(r["algorithm"], r["setting"]) for r in written] == rows
  assert written[0]["published"] == 80.41
  assert all(r["sweep"] == sweep for r in written)
  assert f"wrote the {len(rows)} finished rows" in capsys.readouterr().err


@needs_fashion_mnist
def test_one_command_writes_the_table_next_to_pfllibs_numbers(monkeypatch, tmp_path,
                                                               capsys):
  sweeps = []
  sweep_settings = simulate.sweep_settings
  monkeypatch.setattr(simulate, "sweep_settings", lambda algorithm, configs, *args,
                      **kwargs: sweeps.append((algorithm, list(configs)))
                      or sweep_settings(algorithm, configs, *args, **kwargs))
  assert cli.main([*BOARD, *TINY, "--out", str(tmp_path)]) == 0
  # One sweep per algorithm runs both settings side by side.
  assert sweeps == [(a, ["pathological", "dirichlet"]) for a in ("fedavg", "fedper")]
  report = json.loads((tmp_path / "leaderboard.json").read_text())
  rows = report["rows"]
  assert [(r["algorithm"], r["setting"]) for r in rows] == [
      ("fedavg", "pathological"), ("fedper", "pathological"),
      ("fedavg", "dirichlet"), ("fedper", "dirichlet")]
  for r in rows:
    assert (r["seeds"], r["rounds"]) == (2, 2) and r["seconds_per_round"] > 0
    assert 0.0 <= r["accuracy_mean"] <= 100.0
    assert r["published"] == presets.get(
        f"pfllib-fmnist-{r['setting']}").paper[r["algorithm"]]
    assert r["sweep"] == ["pathological", "dirichlet"]
    shared = next(o for o in rows if o["algorithm"] == r["algorithm"])
    assert r["seconds_per_round"] == shared["seconds_per_round"]
  assert report["configs"]["dirichlet"]["preset"] == "pfllib-fmnist-dirichlet"
  table = (tmp_path / "leaderboard.md").read_text()
  assert table == leaderboard.table(presets.leaderboard("pfllib-fmnist"), rows)
  assert "| PFLlib |" in table.splitlines()[0]
  assert "| fedper | dirichlet | 2 | 2 |" in table and "| 97.44 |" in table
  assert table in capsys.readouterr().out

  # benchmarks/leaderboard.py runs the same rows (its timings aside).
  timeless = lambda rows: [{**r, "seconds_per_round": None} for r in rows]
  assert timeless(_script().rows_of([*BOARD, *TINY])) == timeless(rows)


def test_the_script_asks_pflax_run_for_its_sizes():
  script = _script()
  flags = lambda **given: script.run_flags(argparse.Namespace(**{
      "slice": False, "quick": False, "rounds": None, "eval_every": None,
      "samples_per_client": None, "algorithms": None, **given}))
  assert flags() == [*BOARD, "--no-progress"]
  assert flags(slice=True) == [*BOARD, "--no-progress", "--rounds", "100",
                               "--eval-every", "100"]
  assert flags(slice=True, quick=True, rounds=4, algorithms=["fedavg"]) == [
      *BOARD, "--no-progress", "--rounds", "4", "--eval-every", "3",
      "--samples-per-client", "30", "--algorithms", "fedavg"]
  assert flags(precision="bf16", data_dir="/data/fmnist") == [
      *BOARD, "--no-progress", "--precision", "bf16", "--data-dir", "/data/fmnist"]
  parsed = script.parser.parser().parse_args(flags(precision="bf16", data_dir="/d"))
  assert (parsed.precision, parsed.data_dir) == ("bf16", "/d")


def test_an_interrupted_script_writes_its_finished_rows_without_a_projection(
    monkeypatch, tmp_path):
  script = _script()
  row = {"algorithm": "fedavg", "setting": "pathological", "seeds": 3, "rounds": 100,
         "seconds_per_round": 0.5, "sweep": ["pathological", "dirichlet"],
         "accuracy_mean": 90.0, "accuracy_std": 1.0, "published": 80.41}

  def interrupted(flags, apart, rows):
    rows.append(row)
    raise KeyboardInterrupt

  monkeypatch.setattr(script, "rows_of", interrupted)
  report = tmp_path / "slice.json"
  with pytest.raises(KeyboardInterrupt):
    script.main(["--slice", "--json", str(report), "--out", str(tmp_path / "t.md")])
  written = json.loads(report.read_text())
  assert written["interrupted"] and written["projected_hours"] is None
  assert written["rows"] == [row]
  assert "not projected: interrupted" in (tmp_path / "t.md").read_text()


@pytest.mark.slow
@needs_fashion_mnist
def test_the_script_runs_both_settings_and_writes_the_table(tmp_path):
  out, report = tmp_path / "table.md", tmp_path / "slice.json"
  _script().main(["--slice", "--quick", "--rounds", "3", "--samples-per-client", "20",
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
  assert projected == pytest.approx(  # each algorithm's one sweep of both settings
      sum(r["seconds_per_round"] for r in rows[:2]) * 2000 / 3600)
  table = out.read_text()
  assert "| fedper | dirichlet | 3 | 3 |" in table and "| 97.44 |" in table
