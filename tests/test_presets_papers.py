"""Every paper value of a preset equals the number read from the paper's own text
(issue 34): each expected value below is parsed from a line of
shared/papers/<method>.txt (the project's contract), never copied from the
preset, so a slip in either the preset or its source line fails here."""

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
  with open(os.path.join(PAPERS, paper), encoding="utf-8") as f:
    text = f.read().splitlines()[line - 1]
  found = re.search(pattern, text, re.IGNORECASE)
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
