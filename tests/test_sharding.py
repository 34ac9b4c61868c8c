"""The client axis sharded over 8 forced CPU devices (in a subprocess)."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import pytest

from pflax import data
from pflax import simulate
from pflax._src.data import federation

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    import numpy as np
    from pflax import simulate
    from pflax._src.simulation import simulate as simulate_lib

    name, devices = sys.argv[1], int(sys.argv[2])
    config = simulate.ExperimentConfig(clients=6, rounds=2, model="mlp", strategy="vmap",
                                       local_epochs=1)
    setups = {s: simulate.prepare(config, s) for s in (0, 1)}
    mesh = jax.make_mesh((devices,), ("clients",),
                         axis_types=(jax.sharding.AxisType.Auto,))
    single = simulate.sweep(name, config, [0, 1], setups=setups)
    sharded = simulate.sweep(name, config, [0, 1], setups=setups, mesh=mesh)

    grid = simulate_lib._Grid(name, config, [0, 1], None, (),
                              {(None, s): setups[s] for s in (0, 1)}, mesh)
    carry, metrics = grid.round(grid.start(), 0)
    padded = grid.feds[0].num_samples.shape[1]
    layouts = []
    for path, leaf in jax.tree_util.tree_leaves_with_path((carry, metrics, grid.feds)):
      if leaf.ndim >= 2 and leaf.shape[1] == padded:
        layouts.append({"leaf": jax.tree_util.keystr(path),
                        "split": leaf.sharding.spec == jax.sharding.PartitionSpec(
                            None, "clients"),
                        "devices": len(leaf.sharding.device_set),
                        "shard_clients": leaf.sharding.shard_shape(leaf.shape)[1]})
    print(json.dumps({"single": [r.to_json() for r in single],
                      "sharded": [r.to_json() for r in sharded], "padded": padded,
                      "devices": jax.device_count(), "layouts": layouts}))
""")


def _run(name, devices):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  out = subprocess.run([sys.executable, "-c", SCRIPT, name, str(devices)], env=env,
                       capture_output=True, text=True, check=False, timeout=1800)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def _assert_same(a, b):
  for x, y in zip(a["history"], b["history"]):
    assert x["dropped_clients"] == y["dropped_clients"]
    assert x["train_loss"] == pytest.approx(y["train_loss"], rel=1e-4)
    for key in ("personalized_accuracy", "global_accuracy", "exclusive_accuracy"):
      assert (key in x) == (key in y)
      if key in x:
        assert x[key] == pytest.approx(y[key], abs=1 / 400)  # one test sample
  assert len(a["output_norms"]) == len(b["output_norms"]) == 6


@pytest.mark.parametrize("name,devices", [
    # 6 clients padded to 8, two per device (slow: CI runs it in its slow pass)
    pytest.param("fedavg", 4, marks=[pytest.mark.slow, pytest.mark.extended]),
    # exclusive models mix across devices:
    pytest.param("feddwa", 8, marks=[pytest.mark.slow, pytest.mark.extended]),
    pytest.param("cwfedavg", 4, marks=pytest.mark.slow),
    pytest.param("fedrema", 8, marks=pytest.mark.slow),
])
def test_sharded_run_equals_single_device_and_stays_split(name, devices):
  out = _run(name, devices)
  assert out["devices"] == 8 and out["padded"] == 8
  for a, b in zip(out["sharded"], out["single"]):
    _assert_same(a, b)
  assert out["layouts"], "no client-axis leaves found"
  split = {l["leaf"] for l in out["layouts"]}
  assert {"[2][0].x", "[2][0].counts", "[1].losses"} <= split, split
  if name in ("feddwa", "fedrema"):  # per-client models (FedAvg keeps a global one,
    assert any("kernel" in leaf for leaf in split), split  # cwFedAvg class models)
  if name == "cwfedavg":
    assert "[0].state.class_dist" in split, split
  for layout in out["layouts"]:
    assert layout["split"], layout
    assert layout["devices"] == devices, layout
    assert layout["shard_clients"] == 8 // devices, layout


def test_explicit_mesh_axes_are_rejected():
  config = simulate.ExperimentConfig(clients=2, rounds=1, model="mlp", local_epochs=1)
  mesh = jax.make_mesh((1,), ("clients",),
                       axis_types=(jax.sharding.AxisType.Explicit,))
  with pytest.raises(ValueError, match="AxisType.Auto"):
    simulate.sweep("fedavg", config, [0], mesh=mesh)


def test_pad_clients_appends_empty_clients():
  config = simulate.ExperimentConfig(clients=3, model="mlp")
  fed = data.stack_federations([simulate.prepare(config, 0).federation])
  padded = federation.pad_clients(fed, 4)
  assert padded.x.shape[1] == 4 and padded.counts.shape[1] == 4
  assert not padded.mask[:, 3].any() and not padded.test_mask[:, 3].any()
  assert int(padded.num_samples[0, 3]) == 0


@pytest.mark.slow
def test_cli_devices_splits_clients(tmp_path):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
  out = subprocess.run(
      [sys.executable, "-m", "pflax", "--algorithms", "fedavg", "--clients", "6",
       "--rounds", "1", "--model", "mlp", "--local-epochs", "1", "--devices", "4",
       "--out", str(tmp_path), "--no-progress"],
      env=env, capture_output=True, text=True, check=False, timeout=1800)
  assert out.returncode == 0, out.stderr[-3000:]
  with open(tmp_path / "results.json") as f:
    results = json.load(f)
  assert results["config"]["devices"] == 4
  assert len(results["runs"][0]["output_norms"]) == 6
