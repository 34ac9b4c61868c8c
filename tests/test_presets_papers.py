"""Every paper value of a preset equals the number read from the paper's own text
(issue 34): each expected value below is parsed from a line of
shared/papers/<method>.txt (the project's contract), never copied from the
preset, so a slip in either the preset or its source line fails here. PFLlib's
two presets are read from PFLlib's README, which is not among the project's
papers: they are not checked here."""

import os
import re

import pytest

from pflax._src.cli import presets

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPERS = next((p for p in (os.environ.get("PFLAX_PAPERS", ""),
                           os.path.join(_REPO, os.pardir, "shared", "papers"),
                           os.path.join(_REPO, os.pardir, os.pardir, "shared", "papers"),
                           "/work/shared/papers") if p and os.path.isdir(p)), "")
"""The papers' text: $PFLAX_PAPERS, or the project's shared/papers folder."""
pytestmark = pytest.mark.skipif(not os.path.isdir(PAPERS),
                                reason="the papers' text is not next to the project")


def paper_number(paper: str, line: int, pattern: str) -> float:
  """The number the regex `pattern` captures on line `line` (from 1) of a paper."""
  found = re.search(pattern, paper_line(paper, line), re.IGNORECASE)
  assert found, f"{paper} line {line} does not say {pattern!r}"
  return float(found.group(1).replace(",", ""))


def _presets(prefix):
  return [presets.get(n) for n in presets.names() if n.startswith(prefix)]


def test_fedsa_presets_are_the_papers_lines_100_and_102():
  expected = {
      "rounds": paper_number("fedsa.txt", 100, r"global training rounds to (\d+)"),
      "clients": paper_number("fedsa.txt", 100, r"number of clients to (\d+)"),
      "participation": paper_number("fedsa.txt", 100, r"per round to ([\d.]+)\."),
      "local_epochs": paper_number("fedsa.txt", 100,
                                   r"local training rounds per client to (\d+)"),
  }
  thresholds = {
      "cv_threshold": paper_number("fedsa.txt", 102, r"low-dispersion regions, .*?, "
                                   r"to ([\d.]+),"),
      "sim_threshold": paper_number("fedsa.txt", 102, r"minimum similarity between "
                                    r"clients, .*?, to ([\d.]+)\."),
      "num_mic": paper_number("fedsa.txt", 102, r"number of MIC to (\d+),"),
      "num_mac": paper_number("fedsa.txt", 102, r"number of MAC to (\d+),"),
  }
  assert thresholds == {"cv_threshold": 0.2, "sim_threshold": 0.2, "num_mic": 4,
                        "num_mac": 4}   # CIFAR-10's, the first of each list
  for preset in _presets("fedsa-"):
    assert {k: preset.config[k] for k in expected} == expected, preset.name
    assert preset.config["hyperparameters"]["fedsa"] == thresholds, preset.name


def test_cwfedavg_presets_are_the_papers_line_234():
  line = 234
  expected = {
      "clients": paper_number("cwfedavg.txt", line, r"to (\d+) clients as the default"),
      "lr": paper_number("cwfedavg.txt", line, r"learning rate of ([\d.]+),"),
      "batch_size": paper_number("cwfedavg.txt", line, r"batch size of (\d+),"),
      "local_epochs": paper_number("cwfedavg.txt", line, r"(\d+) local epoch"),
      "rounds": paper_number("cwfedavg.txt", line, r"runs for ([\d,]+) communication"),
  }
  lam = paper_number("cwfedavg.txt", line, r"to (\d+) for MNIST and CIFAR-10")
  for preset in _presets("cwfedavg-"):
    assert {k: preset.config[k] for k in expected} == expected, preset.name
    # wdr_coef = lambda / 2: Eq. 8 adds lambda R, the authors' code 0.5 lambda R.
    assert preset.config["hyperparameters"]["cwfedavg"]["wdr_coef"] == lam / 2


def test_feddwa_presets_are_the_papers_line_166():
  line = 166
  expected = {
      "local_epochs": paper_number("feddwa.txt", line, r"local training rounds .*? "
                                   r"set to (\d+),"),
      "lr": paper_number("feddwa.txt", line, r"learning rate was uniformly set to "
                         r"([\d.]+),"),
      "batch_size": paper_number("feddwa.txt", line, r"batch size was set to (\d+),"),
  }
  keywords = {
      "lam": paper_number("feddwa.txt", line, r"parameter λ was set to ([\d.]+)\."),
      "alpha": paper_number("feddwa.txt", line, r"weight α was set to ([\d.]+)\."),
  }
  twenty = {"clients": paper_number("feddwa.txt", line, r"total number of clients "
                                    r"was set to (\d+),"),
            "participation": paper_number("feddwa.txt", line, r"participation rate F "
                                          r"was set to ([\d.]+)\.")}
  cifar_rounds = paper_number("feddwa.txt", line, r"rounds to (\d+), \d+, and \d+ in "
                              r"the CIFAR-10")
  for preset in _presets("feddwa-"):
    assert {k: preset.config[k] for k in expected} == expected, preset.name
    assert preset.config["hyperparameters"]["feddwa"] == keywords, preset.name
    if "100-clients" not in preset.name:
      assert {k: preset.config[k] for k in twenty} == twenty, preset.name
    if "cifar10" in preset.name:
      assert preset.config["rounds"] == cifar_rounds, preset.name


def test_fedrema_presets_are_the_papers_lines_136_222_and_230():
  expected = {
      "rounds": paper_number("fedrema.txt", 222, r"\$T = (\d+)\$"),
      "local_epochs": paper_number("fedrema.txt", 222, r"\$E = (\d+)\$"),
      "batch_size": paper_number("fedrema.txt", 222, r"batch size is set to (\d+),"),
      "lr": paper_number("fedrema.txt", 222, r"\\eta = ([\d.]+)\$"),
      "samples_per_client": paper_number("fedrema.txt", 230, r"each client to be "
                                         r"(\d+) "),
      "iid_fraction": paper_number("fedrema.txt", 230, r"\$s = ([\d.]+)\$"),
  }
  train, test = (paper_number("fedrema.txt", 230, pattern) for pattern in
                 (r"via a (\d+):\d+ ratio", r"via a \d+:(\d+) ratio"))
  mu = paper_number("fedrema.txt", 222, r"For FedProx, μ is set to (\d+)\.")
  temperature = paper_number("fedrema.txt", 136, r"we set \$M = ([\d.]+)\$")
  for preset in _presets("fedrema-"):
    assert {k: preset.config[k] for k in expected} == expected, preset.name
    assert preset.config["test_fraction"] == test / (train + test), preset.name
    assert preset.config["hyperparameters"]["fedprox"]["mu"] == mu, preset.name
    assert preset.config["hyperparameters"]["fedrema"]["temperature"] == temperature



def paper_line(paper: str, line: int) -> str:
  """Line `line` (from 1) of a paper's text."""
  with open(os.path.join(PAPERS, paper), encoding="utf-8") as f:
    return f.read().splitlines()[line - 1]


def paper_means(paper: str, line: int) -> list[float]:
  """The numbers of a table row on line `line` of a paper, a "mean ± std" cell
  read as its mean: every number that does not follow a "±"."""
  tokens = paper_line(paper, line).split()
  return [float(t) for before, t in zip([""] + tokens, tokens)
          if before != "±" and re.fullmatch(r"\d+(\.\d+)?", t)]


def _fedclassavg_local_update(preset) -> dict[str, float]:
  """A FedClassAvg preset's Table 1 values: learning rate, batch size, rho, epochs."""
  optimizer = preset.config["optimizers"].get("fedclassavg", preset.config)
  return {"lr": optimizer["lr"], "batch_size": preset.config["batch_size"],
          "rho": preset.config["hyperparameters"]["fedclassavg"]["rho"],
          "local_epochs": preset.config["local_epochs"]}


def test_fedclassavg_presets_are_the_papers_table_1_and_lines_638_to_837():
  table1 = {dataset: dict(zip(("lr", "batch_size", "rho", "local_epochs"),
                              paper_means("fedclassavg.txt", line)))
            for dataset, line in (("cifar10", 670), ("fashion_mnist", 672))}
  assert table1["fashion_mnist"] == {"lr": 0.0006, "batch_size": 64, "rho": 0.4662,
                                     "local_epochs": 1}   # the row read as a row
  clients = paper_number("fedclassavg.txt", 638, r"(\d+) clients were simulated")
  participation = {20: paper_number("fedclassavg.txt", 814, r"set to ([\d.]+) for 20"),
                   100: paper_number("fedclassavg.txt", 814, r"and ([\d.]+) for 100")}
  alpha = paper_number("fedclassavg.txt", 837, r"Dir\(([\d.]+)\) for Dirichlet")
  assert alpha == paper_number("fedclassavg.txt", 808, r"assumed to be Dir\(([\d.]+)\)")
  skewed = {"two": 2}[re.search(r"only contain (\w+) classes",
                                paper_line("fedclassavg.txt", 837)).group(1)]
  # Lines 755-757: "KT-pFL initializes local models by training one local epoch
  # while FedClassAvg does not": no warm-up epoch.
  assert "one local epoch while" in paper_line("fedclassavg.txt", 755)
  assert paper_line("fedclassavg.txt", 757).startswith("FedClassAvg does not.")
  found = _presets("fedclassavg-")
  assert len(found) == 8
  for preset in found:
    config = preset.config
    m = 100 if preset.name.endswith("-100-clients") else clients
    assert (config["clients"], config["participation"]) == (m, participation[m]), (
        preset.name)
    expected = dict(table1[config["dataset"]])
    if preset.name.endswith(("-ablation-ca", "-ablation-ca-cl")):
      expected["rho"] = 0.0   # Table 4's columns without PR (lines 942-943)
    assert _fedclassavg_local_update(preset) == expected, preset.name
    assert config["hyperparameters"]["fedclassavg"]["warmup_epochs"] == 0, preset.name
    if config["partition"] == "dirichlet":
      assert config["dirichlet_alpha"] == alpha, preset.name
    else:
      assert config["classes_per_client"] == skewed, preset.name


def test_fedclassavg_presets_report_the_papers_tables_2_3_and_4():
  # Table 2 (lines 840-851): CIFAR-10 Dir, Skewed; Fashion-MNIST Dir, Skewed; ...
  local, proposed = (paper_means("fedclassavg.txt", line) for line in (846, 851))
  for setting, column in (("cifar10-dirichlet", 0), ("fmnist-dirichlet", 2),
                          ("fmnist-pathological", 3)):
    preset = presets.get(f"fedclassavg-{setting}-heterogeneous")
    assert preset.paper == {"fedclassavg": proposed[column], "local": local[column]}
  # Table 3 (lines 889-898): CIFAR-10 20, 100 clients; Fashion-MNIST 20, 100; ...
  rows = {name: paper_means("fedclassavg.txt", line)
          for name, line in (("fedavg", 893), ("fedprox", 894), ("fedclassavg", 898))}
  for name, column in (("fedclassavg-fmnist-dirichlet", 2),
                       ("fedclassavg-fmnist-dirichlet-100-clients", 3)):
    assert presets.get(name).paper == {k: v[column] for k, v in rows.items()}, name
  # Table 4 (lines 944-948), Fashion-MNIST: CA, +PR, +CL, +PR, CL.
  ablation = dict(zip(("ca", "ca-pr", "ca-cl", "full"),
                      paper_means("fedclassavg.txt", 948)))
  assert ablation["full"] == proposed[2]   # its last column is Table 2's
  for column in ("ca", "ca-pr", "ca-cl"):
    preset = presets.get(f"fedclassavg-fmnist-ablation-{column}")
    assert preset.paper == {"fedclassavg": ablation[column]}, preset.name
    assert preset.config["hyperparameters"]["fedclassavg"]["supcon"] == (
        column.endswith("cl")), preset.name
