"""Runs every notebook in `notebooks/` top to bottom with nbclient."""

import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted(
    (pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))

LONG = ("aggregator_benchmark", "tune", "your_data")
"""The notebooks that take most of a minute each: they run in the slow pass."""

# The notebooks are small; compile time dominates, so compile fast (as
# `benchmarks/aggregators.py --quick` does). Their timings then mean nothing.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


@pytest.mark.parametrize("path", [
    pytest.param(p, marks=pytest.mark.slow) if p.stem in LONG else p for p in NOTEBOOKS],
                         ids=lambda p: p.stem)
def test_notebook_runs(path, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS",
                     f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip())
  notebook = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": str(path.parent)}})
  client.execute()
