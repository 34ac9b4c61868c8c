"""`pflax-run --preset`: the papers' settings resolve to complete configurations."""

import json

import pytest

from pflax import simulate
from pflax._src.cli import main as cli
from pflax._src.cli import parser as cli_parser
from pflax._src.cli import presets


@pytest.mark.parametrize("name", presets.names())
def test_every_preset_resolves_and_is_recorded(name, capsys, tmp_path):
  preset = presets.get(name)
  presets.check(preset, cli_parser.CONFIG_FIELDS + ("optimizers", "hyperparameters"))
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
  assert config["seeds"] == list(preset.seeds)
  assert preset.sources and preset.description
  assert set(preset.paper) == set(preset.algorithms) and "paper" in preset.sources


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


PAPER = {
    # cwfedavg.txt lines 207-215 (Table 1).
    "cwfedavg-cifar10-pathological": {"cwfedavg": 91.23, "fedavg": 60.68,
                                      "fedprox": 60.65},
    "cwfedavg-mnist-dirichlet": {"cwfedavg": 99.52, "fedavg": 98.70, "fedprox": 98.68},
    "cwfedavg-cifar10-dirichlet": {"cwfedavg": 88.65, "fedavg": 61.94,
                                   "fedprox": 62.48},
    # fedclassavg.txt lines 846-851 (Table 2), 893-898 (Table 3), 948 (Table 4).
    "fedclassavg-cifar10-dirichlet-heterogeneous": {"fedclassavg": 0.7670,
                                                    "local": 0.6894},
    "fedclassavg-fmnist-dirichlet-heterogeneous": {"fedclassavg": 0.9303,
                                                   "local": 0.8840},
    "fedclassavg-fmnist-pathological-heterogeneous": {"fedclassavg": 0.9800,
                                                      "local": 0.9430},
    "fedclassavg-fmnist-dirichlet": {"fedclassavg": 0.9294, "fedavg": 0.8988,
                                     "fedprox": 0.9025},
    "fedclassavg-fmnist-dirichlet-100-clients": {"fedclassavg": 0.6712,
                                                 "fedavg": 0.7471, "fedprox": 0.7477},
    "fedclassavg-fmnist-ablation-ca": {"fedclassavg": 0.8578},
    "fedclassavg-fmnist-ablation-ca-pr": {"fedclassavg": 0.8971},
    "fedclassavg-fmnist-ablation-ca-cl": {"fedclassavg": 0.924},
    # fedsa.txt lines 68-76 (Table 1).
    "fedsa-cifar10-pathological": {"fedsa": 91.36, "fedavg": 90.79, "fedprox": 90.75},
    "fedsa-cifar10-dirichlet": {"fedsa": 90.41, "fedavg": 88.55, "fedprox": 88.94},
    # feddwa.txt lines 305-316 (Table 1), 217-228 (Table A1: 20% before 100%).
    "feddwa-cifar10-dirichlet": {"feddwa": 86.97, "fedavg": 53.44},
    "feddwa-cifar10-pathological": {"feddwa": 85.2, "fedavg": 39.53},
    "feddwa-fmnist-pathological": {"feddwa": 98.75, "fedavg": 75.28,
                                   "fedavg_ft": 98.64, "ditto": 98.24, "fedala": 98.68},
    "feddwa-fmnist-pathological-100-clients": {"feddwa": 98.39, "fedavg": 75.44,
                                               "fedavg_ft": 98.06, "ditto": 98.06,
                                               "fedala": 98.12},
    # PFLlib's leaderboard (README, Fashion-MNIST), as issue 24 quotes it.
    "pfllib-fmnist-pathological": {"fedavg": 80.41, "fedprox": 78.08, "fedper": 99.47,
                                   "ditto": 99.44, "fedrep": 99.56, "fedbabu": 99.41,
                                   "apfl": 99.41, "fedala": 99.57},
    "pfllib-fmnist-dirichlet": {"fedavg": 85.85, "fedprox": 85.63, "fedper": 97.44,
                                "ditto": 97.47, "fedrep": 97.56, "fedbabu": 97.46,
                                "apfl": 97.25, "fedala": 97.66},
    # fedrema.txt lines 234-245 (Table 1).
    "fedrema-cifar10-groups": {"fedrema": 65.4, "fedavg": 61.9, "fedprox": 61.6,
                               "local": 58.9, "moon": 61.9, "fedper": 59.5,
                               "fedbabu": 53.6},
    "fedrema-fmnist-groups": {"fedrema": 88.2, "fedavg": 86.1, "fedprox": 84.8,
                              "local": 86.0, "moon": 86.0, "fedper": 86.1,
                              "fedbabu": 83.1},
}


def test_every_preset_stores_the_papers_numbers():
  assert {name: dict(presets.get(name).paper) for name in presets.names()} == PAPER


def _resolved(name, capsys, tmp_path, *flags):
  assert cli.main(["--preset", name, "--print-config", "--out", str(tmp_path),
                   *flags]) == 0
  return json.loads(capsys.readouterr().out)


def test_fedrema_fmnist_from_the_paper(capsys, tmp_path):
  rema = _resolved("fedrema-fmnist-groups", capsys, tmp_path)
  # fedrema.txt line 230: 600 samples per client, 4:1, s = 0.2, 5 seeds; line 222:
  # SGD, T = 500, E = 5, batch 100, lr 0.01, FedProx mu = 1.
  assert (rema["dataset"], rema["partition"], rema["iid_fraction"]) == (
      "fashion_mnist", "groups", 0.2)
  assert (rema["samples_per_client"], rema["test_fraction"], rema["test_split"]) == (
      600, 0.2, "clients")
  assert rema["seeds"] == [0, 1, 2, 3, 4]
  assert (rema["rounds"], rema["local_epochs"], rema["batch_size"]) == (500, 5, 100)
  assert rema["optimizers"]["fedrema"]["lr"] == 0.01
  assert rema["hyperparameters"]["fedprox"]["mu"] == 1.0
  assert rema["algorithms"] == ["fedrema", "fedavg", "fedprox", "local", "moon",
                                "fedper", "fedbabu"]
  cifar = _resolved("fedrema-cifar10-groups", capsys, tmp_path)
  same = lambda c: {k: v for k, v in c.items() if k not in ("dataset", "preset")}
  assert same(cifar) == same(rema)                  # Table 1: one setting


def test_feddwa_fmnist_from_the_paper(capsys, tmp_path):
  # feddwa.txt line 210: 2 classes per client; 20 clients, 100%, 100 rounds; 100
  # clients, 20%, 300 rounds. Line 166: SGD, 5 epochs, lr 0.01, batch 16.
  for name, clients, participation, rounds in (
      ("feddwa-fmnist-pathological", 20, 1.0, 100),
      ("feddwa-fmnist-pathological-100-clients", 100, 0.2, 300)):
    dwa = _resolved(name, capsys, tmp_path)
    assert (dwa["dataset"], dwa["partition"], dwa["classes_per_client"]) == (
        "fashion_mnist", "pathological", 2)
    assert (dwa["clients"], dwa["participation"], dwa["rounds"]) == (
        clients, participation, rounds)
    assert (dwa["local_epochs"], dwa["batch_size"], dwa["lr"]) == (5, 16, 0.01)
    assert dwa["hyperparameters"]["feddwa"]["alpha"] == 0.2
    assert dwa["algorithms"] == ["feddwa", "fedavg", "fedavg_ft", "ditto", "fedala"]


@pytest.mark.parametrize("name,partition,heterogeneous,clients,participation", [
    ("fedclassavg-fmnist-dirichlet-heterogeneous", "dirichlet", True, 20, 1.0),
    ("fedclassavg-fmnist-pathological-heterogeneous", "pathological", True, 20, 1.0),
    ("fedclassavg-fmnist-dirichlet", "dirichlet", False, 20, 1.0),
    ("fedclassavg-fmnist-dirichlet-100-clients", "dirichlet", False, 100, 0.1),
])
def test_fedclassavg_fmnist_from_the_paper(name, partition, heterogeneous, clients,
                                           participation, capsys, tmp_path):
  fca = _resolved(name, capsys, tmp_path)
  # fedclassavg.txt line 672: lr 0.0006, batch 64, rho 0.4662, 1 epoch; lines
  # 590-592, 835-837: Dir(0.5), or two classes per client; line 814: 20 clients
  # at rate 1, 100 at 0.1; the authors' code: Adam (0.5, 0.999), test sets drawn
  # from the test split.
  assert (fca["dataset"], fca["partition"], fca["heterogeneous"]) == (
      "fashion_mnist", partition, heterogeneous)
  assert fca["dirichlet_alpha"] == 0.5 or partition == "pathological"
  assert fca["classes_per_client"] == 2 or partition == "dirichlet"
  assert (fca["clients"], fca["participation"]) == (clients, participation)
  assert (fca["batch_size"], fca["local_epochs"], fca["test_split"]) == (
      64, 1, "dataset")
  for algorithm in fca["algorithms"]:
    assert fca["optimizers"][algorithm] == {"optimizer": "adam", "lr": 0.0006,
                                            "momentum": 0.0, "adam_b1": 0.5,
                                            "grad_clip": None}
  assert fca["hyperparameters"]["fedclassavg"]["rho"] == 0.4662
  assert fca["hyperparameters"]["fedclassavg"]["warmup_epochs"] == 0


@pytest.mark.parametrize("name,rho,supcon", [
    ("fedclassavg-fmnist-ablation-ca", 0.0, False),
    ("fedclassavg-fmnist-ablation-ca-pr", 0.4662, False),
    ("fedclassavg-fmnist-ablation-ca-cl", 0.0, True),
    ("fedclassavg-fmnist-dirichlet-heterogeneous", 0.4662, True),   # +PR, CL
])
def test_fedclassavg_ablation_switches_each_term(name, rho, supcon, capsys, tmp_path):
  # fedclassavg.txt line 948 (Table 4): CA, +PR, +CL, +PR, CL.
  fca = _resolved(name, capsys, tmp_path)
  keywords = fca["hyperparameters"]["fedclassavg"]
  assert (keywords["rho"], keywords["supcon"]) == (rho, supcon)
  full = _resolved("fedclassavg-fmnist-dirichlet-heterogeneous", capsys, tmp_path)
  same = lambda c: {k: v for k, v in c.items() if k not in (
      "preset", "hyperparameters", "optimizers", "algorithms")}
  assert same(fca) == same(full)
  assert fca["optimizers"]["fedclassavg"] == full["optimizers"]["fedclassavg"]
  others = lambda c: {k: v for k, v in c["hyperparameters"]["fedclassavg"].items()
                      if k not in ("rho", "supcon")}
  assert others(fca) == others(full)


def test_seeds_flag_overrides_a_presets_seeds(capsys, tmp_path):
  config = _resolved("fedrema-fmnist-groups", capsys, tmp_path, "--seeds", "7")
  assert config["seeds"] == [7]


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


@pytest.mark.parametrize("name,partition", [("pfllib-fmnist-pathological", "pathological"),
                                            ("pfllib-fmnist-dirichlet", "dirichlet")])
def test_pfllib_fmnist_leaderboard_settings(name, partition, capsys, tmp_path):
  # PFLlib: 20 clients, 75/25, batch 10, 1 epoch, SGD lr 0.005, 2000 rounds.
  config = _resolved(name, capsys, tmp_path)
  assert (config["dataset"], config["partition"], config["clients"]) == (
      "fashion_mnist", partition, 20)
  assert (config["local_epochs"], config["batch_size"], config["lr"],
          config["rounds"], config["test_fraction"]) == (1, 10, 0.005, 2000, 0.25)
  assert config["classes_per_client"] == 2 or partition == "dirichlet"
  assert config["dirichlet_alpha"] == 0.1 or partition == "pathological"
  assert config["algorithms"] == ["fedavg", "fedprox", "fedper", "ditto", "fedrep",
                                  "fedbabu", "apfl", "fedala"]
