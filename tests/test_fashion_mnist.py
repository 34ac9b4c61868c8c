"""The real Fashion-MNIST, offline: `apt-get install dataset-fashion-mnist` (CI
installs it where apt can; these tests are skipped elsewhere)."""

import json
import os

import pytest

from pflax._src.cli import main as cli
from pflax._src.data import datasets

pytestmark = pytest.mark.skipif(
    not os.path.isdir(datasets.DEBIAN_FASHION_MNIST),
    reason=f"Fashion-MNIST is not installed in {datasets.DEBIAN_FASHION_MNIST} "
           "(apt-get install dataset-fashion-mnist)")


@pytest.mark.slow
def test_pflax_run_on_fashion_mnist_from_debians_package(tmp_path, capsys):
  """`pflax-run --dataset fashion_mnist` after the apt package, as a new user runs it:
  70,000 images over 10 clients, two rounds that learn."""
  out = tmp_path / "run"
  assert cli.main(["--dataset", "fashion_mnist", "--algorithms", "local", "fedavg",
                   "--clients", "10", "--rounds", "2", "--local-epochs", "1",
                   "--model", "mlp", "--out", str(out), "--no-progress",
                   "--no-compilation-cache"]) == 0
  results = json.loads((out / "results.json").read_text())
  assert results["config"]["dataset"] == "fashion_mnist"
  counts = results["class_counts"]
  assert len(counts) == 10 and len(counts[0]) == 10
  trained = sum(map(sum, counts))
  assert 0.74 * 70_000 < trained < 0.76 * 70_000     # 75% of every client's data
  for run in results["runs"]:
    assert run["personalized_accuracy"]["last"] > 0.5   # ten classes: chance is 0.1
  assert "| local |" in capsys.readouterr().out


@pytest.mark.slow
def test_feddwa_beats_fedavg_on_the_pathological_fashion_mnist_preset(tmp_path):
  """`--preset feddwa-fmnist-pathological` end to end, reduced as
  `benchmarks/reproduce_fmnist.py --size cpu` reduces it but smaller (the MLP,
  200 samples per client, 5 rounds): FedDWA's personalized accuracy beats
  FedAvg's on every seed, as in the paper's Table A1 (98.75 against 75.28)."""
  out = tmp_path / "run"
  assert cli.main(["--preset", "feddwa-fmnist-pathological", "--model", "mlp",
                   "--algorithms", "feddwa", "fedavg", "--samples-per-client", "200", "--rounds", "5", "--seeds", "0", "1",
                   "--out", str(out), "--no-progress", "--no-compilation-cache"]) == 0
  runs = json.loads((out / "results.json").read_text())["runs"]
  final = {(r["algorithm"], r["seed"]): r["personalized_accuracy"]["final"]
           for r in runs}
  assert sorted(final) == [("fedavg", 0), ("fedavg", 1), ("feddwa", 0), ("feddwa", 1)]
  for seed in (0, 1):
    assert final["feddwa", seed] > final["fedavg", seed] + 0.15, final
