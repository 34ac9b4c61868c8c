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


def paper_cells(paper: str, line: int, label: str,
                cell: str = r"(\d+\.\d+)±") -> list[float]:
  """The cells of `label`'s table row on line `line` of a paper, each the number
  the regex `cell` captures (by default a "mean±std" cell read as its mean)."""
  text = paper_line(paper, line)
  assert re.match(rf"(\S*\t)?{re.escape(label)}\s", text), (
      f"{paper} line {line} is not {label}'s row")
  return [float(x) for x in re.findall(cell, text)]


def paper_run_together(paper: str, line: int, label: str, cells: int) -> list[float]:
  """The `cells` numbers of `label`'s table row on line `line` of a paper whose
  cells run together ("FedAvg37.4739.53..."): each read as 12.3 or 12.34 (every
  accuracy of those tables lies in [10, 100)), and the row has one such reading."""
  text = paper_line(paper, line)
  assert text.startswith(label), f"{paper} line {line} is not {label}'s row"
  readings = _readings(text[len(label):], cells)
  assert len(readings) == 1, f"{paper} line {line} reads as {readings}"
  return readings[0]


def _readings(digits: str, cells: int) -> list[list[float]]:
  """Every reading of `digits` as `cells` numbers of the form 12.3 or 12.34."""
  if not cells:
    return [] if digits else [[]]
  return [[float(digits[:n])] + rest for n in (4, 5)
          if re.fullmatch(r"\d\d\.\d" + r"\d" * (n - 4), digits[:n])
          for rest in _readings(digits[n:], cells - 1)]


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


def test_cwfedavg_presets_partition_and_participation_are_the_papers_lines_230_234():
  alpha = paper_number("cwfedavg.txt", 230, r"We use α=([\d.]+)\\alpha")
  assert alpha == paper_number("cwfedavg.txt", 205, r"Practical setting \(α=([\d.]+)")
  classes = {"two": 2}[re.search(r"specifically (\w+) classes for MNIST and CIFAR-10",
                                 paper_line("cwfedavg.txt", 230)).group(1)]
  # Line 234: "20 clients as the default participating in each round".
  participating = paper_number("cwfedavg.txt", 234, r"(\d+) clients as the default "
                               r"participating in each round")
  for preset in _presets("cwfedavg-"):
    config = preset.config
    assert config["participation"] * config["clients"] == participating, preset.name
    if config["partition"] == "dirichlet":
      assert config["dirichlet_alpha"] == alpha, preset.name
    else:
      assert config["classes_per_client"] == classes, preset.name


def test_cwfedavg_presets_report_the_papers_table_1():
  # Table 1 (lines 205-215): Pathological CIFAR-10, CIFAR-100; Practical MNIST,
  # CIFAR-10, ... (the text lost the column spans: cwfedavg-mnist-dirichlet's reading).
  assert paper_line("cwfedavg.txt", 206).startswith(
      "CIFAR-10 CIFAR-100 MNIST CIFAR-10 ")
  rows = {name: paper_cells("cwfedavg.txt", line, label) for name, line, label in (
      ("fedavg", 207, "FedAvg"), ("fedprox", 208, "FedProx"),
      ("cwfedavg", 215, "cwFedAvg (Output)"))}
  found = {"cwfedavg-cifar10-pathological": 0, "cwfedavg-mnist-dirichlet": 2,
           "cwfedavg-cifar10-dirichlet": 3}
  assert {p.name for p in _presets("cwfedavg-")} == set(found)
  for name, column in found.items():
    preset = presets.get(name)
    assert preset.paper == {k: rows[k][column] for k in preset.algorithms}, name


def test_fedsa_presets_partition_as_the_papers_line_98():
  alpha = paper_number("fedsa.txt", 98, r"we set =([\d.]+) for the experiments")
  classes = paper_number("fedsa.txt", 98, r"we allocate (\d+), \d+, and \d+ classes "
                         r"for CIFAR-10,")
  for preset in _presets("fedsa-"):
    if preset.config["partition"] == "dirichlet":
      assert preset.config["dirichlet_alpha"] == alpha, preset.name
    else:
      assert preset.config["classes_per_client"] == classes, preset.name


def test_fedsa_presets_report_the_papers_table_1():
  # Table 1 (lines 66-76): Pathological CIFAR-10, CIFAR-100, Tiny-ImageNet; Practical
  # CIFAR-10, ...; a cell is its mean and std run together, two decimals each.
  header = paper_line("fedsa.txt", 67).split(" | ")
  assert header[1:5] == ["CIFAR-10", "CIFAR-100", "Tiny-ImageNet", "CIFAR-10"]
  cell = r"\| (\d+\.\d\d)\d\.\d\d(?= \|)"
  rows = {name: paper_cells("fedsa.txt", line, label, cell) for name, line, label in (
      ("fedavg", 68, "FedAvg"), ("fedprox", 69, "FedProx"),
      ("fedsa", 76, "FedSA(ours)"))}
  assert {len(row) for row in rows.values()} == {7}
  for preset in _presets("fedsa-"):
    column = 3 if preset.config["partition"] == "dirichlet" else 0
    assert preset.paper == {k: rows[k][column] for k in preset.algorithms}, preset.name


def test_feddwa_presets_are_the_papers_lines_154_and_210():
  alpha = paper_number("feddwa.txt", 154, r"value of dir to ([\d.]+) and")
  classes = paper_number("feddwa.txt", 154, r"only assigned (\d+) classes to each")
  # Line 210: "When the total number of clients was 20, assuming that 100% of the
  # clients participate in training, the total number of global communications used
  # for training was 100 times; when ... 100, ... 20% ... 300 times."
  settings = {int(m): (int(f) / 100, int(t)) for m, f, t in re.findall(
      r"total number of clients was (\d+), assuming that (\d+)% of the clients "
      r"participate in training, the total number of global communications used for "
      r"training was (\d+) times", paper_line("feddwa.txt", 210))}
  assert len(settings) == 2
  for preset in _presets("feddwa-"):
    config = preset.config
    if config["partition"] == "dirichlet":
      assert config["dirichlet_alpha"] == alpha, preset.name
      continue
    assert config["classes_per_client"] == classes, preset.name
    m = max(settings) if preset.name.endswith("-100-clients") else min(settings)
    assert (config["clients"], config["participation"], config["rounds"]) == (
        m, *settings[m]), preset.name


def test_feddwa_presets_report_the_papers_tables_1_and_a1():
  # Table 1 (lines 305-316): CIFAR-10 dir = 0.3, 0.5; CIFAR-100 ...; Tiny-ImageNet ...
  dirs = [float(d) for d in
          re.findall(r"dir = ([\d.]+)", paper_line("feddwa.txt", 306))]
  table1 = {name: paper_run_together("feddwa.txt", line, label, 6)
            for name, line, label in (("fedavg", 307, "FedAvg"),
                                      ("feddwa", 316, "FedDWA (Ours)"))}
  preset = presets.get("feddwa-cifar10-dirichlet")
  assert dirs[0] == preset.config["dirichlet_alpha"]
  assert preset.paper == {k: table1[k][0] for k in preset.algorithms}
  # Table A1 (lines 217-228): CIFAR-10, MNIST, FMNIST, each 20% then 100%.
  assert re.findall(r"CIFAR-10|FMNIST|MNIST", paper_line("feddwa.txt", 217)) == [
      "CIFAR-10", "MNIST", "FMNIST"]
  assert re.findall(r"\d+%", paper_line("feddwa.txt", 218)) == ["20%", "100%"] * 3
  rows = {name: paper_run_together("feddwa.txt", line, label, 6)
          for name, line, label in (("fedavg", 219, "FedAvg"),
                                    ("fedavg_ft", 220, "FedAvg-FT"),
                                    ("ditto", 221, "Ditto"), ("fedala", 227, "FedALA"),
                                    ("feddwa", 228, "FedDWA (Ours)"))}
  for name, column in (("feddwa-cifar10-pathological", 1),
                       ("feddwa-fmnist-pathological", 5),
                       ("feddwa-fmnist-pathological-100-clients", 4)):
    preset = presets.get(name)
    assert preset.paper == {k: rows[k][column] for k in preset.algorithms}, name


def test_fedrema_presets_are_the_papers_lines_189_and_272():
  delta = paper_number("fedrema.txt", 272, r"\$\\delta = ([\d.]+)\$ is the best choice")
  # Algorithm 2, line 189: every client trains in every round.
  assert re.search(r"foreach client\s+\$k \\in \\mathcal\{K\}\$\s+in parallel",
                   paper_line("fedrema.txt", 189))
  for preset in _presets("fedrema-"):
    assert preset.config["hyperparameters"]["fedrema"]["delta"] == delta, preset.name
    assert preset.config["participation"] == 1.0, preset.name


def test_fedrema_presets_report_the_papers_table_1():
  # Table 1 (lines 232-245): MNIST, FMNIST, CIFAR-10 (line 234).
  datasets = paper_line("fedrema.txt", 234).split()[1:]
  rows = {name: paper_cells("fedrema.txt", line, label) for name, line, label in (
      ("local", 235, "Local"), ("fedavg", 236, "FedAvg"), ("fedprox", 237, "FedProx"),
      ("moon", 238, "MOON"), ("fedper", 240, "FedPer"), ("fedbabu", 243, "FedBABU"),
      ("fedrema", 245, "FedReMa"))}
  for preset in _presets("fedrema-"):
    column = datasets.index({"cifar10": "CIFAR-10",
                             "fashion_mnist": "FMNIST"}[preset.config["dataset"]])
    assert preset.paper == {k: rows[k][column] for k in preset.algorithms}, preset.name
