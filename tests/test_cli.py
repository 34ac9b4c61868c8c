"""`pflax-run`: configuration from flags, --set and --config, one-line errors."""

import json
import os
import subprocess
import sys

import pytest

from pflax import simulate
from pflax._src import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--clients", "6", "--rounds", "2", "--model", "mlp", "--local-epochs", "1",
         "--no-progress", "--no-compilation-cache"]


@pytest.mark.parametrize("flags,message", [
    (["--clients", "0"], "--clients must be >= 1, got 0"),
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--participation", "0"], r"--participation must be in \(0, 1\], got 0.0"),
    (["--participation", "1.5"], r"--participation must be in \(0, 1\], got 1.5"),
    (["--dirichlet-alpha", "0"], "--dirichlet-alpha must be a finite number > 0"),
    (["--faulty-clients", "1"], r"--faulty-clients must be a fraction in \[0, 1\)"),
    (["--checkpoint-every", "-1"], "--checkpoint-every must be >= 0, got -1"),
    (["--local-epochs", "0"], "--local-epochs must be >= 1"),
    (["--lr", "-1"], "--lr must be a finite number > 0"),
    (["--algorithms", "nope"], "algorithm must be one of"),
    (["--set", "wdr"], "--set takes KEY=VALUE"),
    (["--set", "wdr=1"], "--set wdr: unknown key; valid keys: .*cwfedavg.wdr_coef"),
    (["--set", "cwfedavg.wdr_coef=x"], "--set cwfedavg.wdr_coef: 'x' is not a float"),
    (["--set", "fedavg.mu=1", "--algorithms", "fedprox"], "--set fedavg.mu: 'fedavg'"),
    (["--set", "wdr_coef=-1", "--algorithms", "cwfedavg"], "wdr_coef must be a finite"),
    (["--set", "alpha=2", "--algorithms", "feddwa"], "alpha must be a finite number"),
    (["--heterogeneous", "--algorithms", "feddwa"], "--heterogeneous needs algorithms"),
])
def test_bad_flags_are_one_line_errors_before_any_work(flags, message, tmp_path):
  with pytest.raises(SystemExit, match="^pflax-run: " + message) as error:
    cli.main(flags + ["--out", str(tmp_path / "out")])
  assert "\n" not in str(error.value)
  assert not (tmp_path / "out").exists()   # nothing ran, nothing was written


def test_unwritable_out_is_an_error_before_training(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("")
  with pytest.raises(SystemExit, match="^pflax-run: --out .* cannot be written"):
    cli.main(SMALL + ["--algorithms", "fedavg", "--out", str(blocker / "sub")])


def test_set_reaches_the_builders_and_is_recorded(tmp_path, capsys):
  code = cli.main(["--algorithms", "cwfedavg", "fedclassavg", "--set", "wdr_coef=2",
                   "--set", "fedclassavg.rho=0.5", "--set", "fedclassavg.lr=1e-4",
                   "--print-config", "--out", str(tmp_path)])
  assert code == 0
  config = json.loads(capsys.readouterr().out)
  assert config["hyperparameters"]["cwfedavg"]["wdr_coef"] == 2.0
  assert config["hyperparameters"]["fedclassavg"]["rho"] == 0.5
  assert config["hyperparameters"]["fedclassavg"]["supcon_temperature"] == 100.0
  assert config["optimizers"]["fedclassavg"] == {
      "optimizer": "adam", "lr": 1e-4, "momentum": 0.0, "adam_b1": 0.5,
      "grad_clip": None}
  assert config["optimizers"]["cwfedavg"]["lr"] == 0.05
  assert not list(tmp_path.iterdir())          # --print-config runs nothing


def test_config_file_reruns_the_experiment_and_flags_override_it(tmp_path, capsys):
  out = tmp_path / "first"
  assert cli.main(SMALL + ["--algorithms", "cwfedavg", "--set", "wdr_coef=2",
                           "--seeds", "3", "--out", str(out)]) == 0
  first = json.loads((out / "results.json").read_text())
  capsys.readouterr()
  assert cli.main(["--config", str(out / "results.json"), "--print-config",
                   "--out", str(tmp_path / "x")]) == 0
  assert json.loads(capsys.readouterr().out) == first["config"]
  again = tmp_path / "again"
  assert cli.main(["--config", str(out / "results.json"), "--out", str(again),
                   "--no-progress", "--no-compilation-cache"]) == 0
  rerun = json.loads((again / "results.json").read_text())
  strip = lambda runs: [{k: v for k, v in r.items() if k != "seconds"} for r in runs]
  assert strip(rerun["runs"]) == strip(first["runs"])
  capsys.readouterr()
  assert cli.main(["--config", str(out / "results.json"), "--rounds", "5",
                   "--print-config", "--out", str(tmp_path / "x")]) == 0
  assert json.loads(capsys.readouterr().out)["rounds"] == 5


def test_config_file_with_unknown_keys_is_refused(tmp_path):
  path = tmp_path / "config.json"
  path.write_text(json.dumps({"config": {"clients": 6, "learning_rate": 0.1}}))
  with pytest.raises(SystemExit, match="unknown keys learning_rate"):
    cli.main(["--config", str(path), "--out", str(tmp_path)])


def test_ctrl_c_is_one_line(monkeypatch, tmp_path, capsys):
  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt
  monkeypatch.setattr(simulate, "prepare", interrupted)
  monkeypatch.setattr(cli.simulate, "prepare", interrupted)
  assert cli.main(SMALL + ["--algorithms", "fedavg", "--out", str(tmp_path)]) == 130
  assert capsys.readouterr().err.strip() == "pflax-run: interrupted"


def test_help_shows_every_default():
  out = subprocess.run([sys.executable, "-m", "pflax", "--help"], capture_output=True,
                       text=True, check=True, cwd=REPO).stdout
  assert "(default: 20)" in out and "(default: 0.05)" in out
  assert "(default: pathological)" in out and "(default: runs/latest)" in out


def test_persistent_compilation_cache_fills_and_can_be_turned_off(tmp_path):
  env = dict(os.environ, PFLAX_CACHE_DIR=str(tmp_path / "cache"))
  command = [sys.executable, "-m", "pflax", "--algorithms", "fedavg", *SMALL[:-1]]
  subprocess.run(command + ["--out", str(tmp_path / "a")], env=env, check=True,
                 capture_output=True, cwd=REPO)
  assert len(os.listdir(tmp_path / "cache")) > 0
  off = dict(env, PFLAX_CACHE_DIR=str(tmp_path / "off"))
  subprocess.run(command + ["--out", str(tmp_path / "b"), "--no-compilation-cache"],
                 env=off, check=True, capture_output=True, cwd=REPO)
  assert not (tmp_path / "off").exists()


def test_download_flag_asks_tfds_to_prepare_first(monkeypatch, tmp_path):
  calls = []

  def load(name, *, data_dir=None, download=False):
    calls.append((name, data_dir, download))
    raise KeyboardInterrupt   # stop before training
  monkeypatch.setattr(cli.datasets, "load", load)
  assert cli.main(SMALL + ["--dataset", "mnist", "--data-dir", str(tmp_path),
                           "--download", "--out", str(tmp_path / "out")]) == 130
  assert calls == [("mnist", str(tmp_path), True)]


def test_without_download_a_missing_dataset_fails_fast(tmp_path):
  pytest.importorskip("tensorflow_datasets")
  with pytest.raises(FileNotFoundError, match="pflax-run --download"):
    cli.main(SMALL + ["--dataset", "mnist", "--data-dir", str(tmp_path),
                      "--out", str(tmp_path / "out")])
