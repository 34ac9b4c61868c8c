"""Two JAX processes on the loopback address (`--distributed`, CPU collectives) give
the single-process results."""

import json
import os
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ["-m", "pflax", "--algorithms", "fedavg", "cwfedavg", "--clients", "6",
          "--rounds", "2", "--model", "mlp", "--local-epochs", "1", "--devices", "2",
          "--seeds", "0", "1", "--no-progress", "--no-compilation-cache"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices: int) -> dict[str, str]:
  return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")


def _runs(path):
  with open(path, encoding="utf-8") as f:
    runs = json.load(f)["runs"]
  return [{k: v for k, v in r.items() if k != "seconds"} for r in runs]


@pytest.mark.slow
def test_two_processes_on_loopback_equal_one_process(tmp_path):
  address = f"127.0.0.1:{_free_port()}"
  processes = [subprocess.Popen(
      [sys.executable, *COMMON, "--distributed", "--coordinator-address", address,
       "--num-processes", "2", "--process-id", str(i), "--out", str(tmp_path / f"p{i}")],
      env=_env(1), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for i in range(2)]
  outputs = [p.communicate(timeout=900) for p in processes]
  for p, (_, err) in zip(processes, outputs):
    assert p.returncode == 0, err[-3000:]
  assert not (tmp_path / "p1" / "results.json").exists()   # only process 0 writes
  single = subprocess.run([sys.executable, *COMMON, "--out", str(tmp_path / "single")],
                          env=_env(2), cwd=REPO, capture_output=True, text=True,
                          check=False, timeout=900)
  assert single.returncode == 0, single.stderr[-3000:]
  distributed = _runs(tmp_path / "p0" / "results.json")
  assert len(distributed) == 4 and all(len(r["history"]) == 2 for r in distributed)
  assert distributed == _runs(tmp_path / "single" / "results.json")
