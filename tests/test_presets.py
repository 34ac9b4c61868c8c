"""`pflax-run --preset`: the papers' settings resolve to complete configurations."""

import json

import pytest

from pflax._src import cli
from pflax._src import presets
from pflax import simulate


@pytest.mark.parametrize("name", presets.names())
def test_every_preset_resolves_and_is_recorded(name, capsys, tmp_path):
  preset = presets.get(name)
  presets.check(preset, cli.CONFIG_FIELDS + ("optimizers", "hyperparameters"))
  assert cli.main(["--preset", name, "--print-config", "--out", str(tmp_path)]) == 0
  config = json.loads(capsys.readouterr().out)
  assert config["preset"] == name and config["algorithms"] == list(preset.algorithms)
  for key, value in preset.config.items():
    if key == "hyperparameters":
      for algorithm, kwargs in value.items():
        for k, v in kwargs.items():
          assert config["hyperparameters"][algorithm][k] == v
    elif key == "optimizers":
      for algorithm, fields in value.items():
        for k, v in fields.items():
          assert config["optimizers"][algorithm][k] == v
    else:
      assert config[key] == value, key
  assert preset.sources and preset.description


def test_headline_values_from_the_papers(capsys, tmp_path):
  def resolved(name):
    cli.main(["--preset", name, "--print-config", "--out", str(tmp_path)])
    return json.loads(capsys.readouterr().out)
  cw = resolved("cwfedavg-cifar10-pathological")
  assert (cw["lr"], cw["batch_size"], cw["local_epochs"], cw["rounds"]) == (
      0.005, 10, 1, 1000)
  assert cw["hyperparameters"]["cwfedavg"]["wdr_coef"] == 5.0    # lambda = 10
  dwa = resolved("feddwa-cifar10-dirichlet")
  assert (dwa["dirichlet_alpha"], dwa["batch_size"], dwa["local_epochs"]) == (0.3, 16, 5)
  rema = resolved("fedrema-cifar10-groups")
  assert rema["optimizers"]["fedrema"] == {"optimizer": "sgd", "lr": 0.01,
                                           "momentum": 0.9, "adam_b1": 0.9,
                                           "grad_clip": 10.0}
  fca = resolved("fedclassavg-cifar10-dirichlet-heterogeneous")
  assert fca["heterogeneous"] and fca["optimizers"]["fedclassavg"]["lr"] == 1e-4


def test_flags_override_a_preset(capsys, tmp_path):
  cli.main(["--preset", "feddwa-cifar10-dirichlet", "--rounds", "3", "--dataset",
            "digits", "--algorithms", "feddwa", "--set", "alpha=0.5", "--print-config",
            "--out", str(tmp_path)])
  config = json.loads(capsys.readouterr().out)
  assert (config["rounds"], config["dataset"], config["algorithms"]) == (
      3, "digits", ["feddwa"])
  assert config["hyperparameters"]["feddwa"]["alpha"] == 0.5
  assert config["batch_size"] == 16                 # the rest is the preset's


def test_list_presets_and_unknown_preset(capsys, tmp_path):
  assert cli.main(["--list-presets"]) == 0
  listed = capsys.readouterr().out
  assert all(name in listed for name in presets.names())
  with pytest.raises(SystemExit, match="unknown preset 'nope'; presets: cwfedavg"):
    cli.main(["--preset", "nope", "--out", str(tmp_path)])


@pytest.mark.slow
def test_a_preset_runs_on_digits(tmp_path):
  assert cli.main(["--preset", "feddwa-cifar10-dirichlet", "--dataset", "digits",
                   "--rounds", "2", "--model", "mlp", "--clients", "6", "--no-progress",
                   "--out", str(tmp_path)]) == 0
  results = simulate.Results.load(str(tmp_path / "results.json"))
  assert [r.algorithm for r in results.runs] == ["feddwa", "fedavg"]
