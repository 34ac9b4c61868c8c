"""A Flower federation on this machine, running pflax's `serverapp` and
`clientapp` (`pflax-run --flower`).

`LocalFederation` starts Flower's deployment engine: one `flower-superlink` and
one `flower-supernode` per client (node config `partition-id=i`), each a
process listening on the loopback address only, with a Flower home of its own
(never the user's `~/.flwr`). With `simulation=True` it starts a SuperLink
with Flower's simulation engine instead (the clients are Ray actors of that
SuperLink; no SuperNode processes). `run` submits an experiment with
`flwr run` and returns its `results.json`. Every process is stopped on exit.
Flower's telemetry and update check are off in every process.
"""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

from pflax._src import records
from pflax._src import flower

LOOPBACK = "127.0.0.1"
CONNECTION = "pflax-local"
QUIET = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
"""Flower's environment switches for no telemetry and no update check."""

_APP_PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "pflax-federation"
version = "1.0.0"
description = "pflax's algorithms as a Flower app (the code is the installed pflax)."
dependencies = []

[tool.flwr.app]
publisher = "pflax"

[tool.flwr.app.components]
serverapp = "pflax.flower:serverapp"
clientapp = "pflax.flower:clientapp"

[tool.flwr.app.config]
experiment = "{}"
out = ""
timeout = 600.0
"""


def write_app(directory: str) -> str:
  """Writes the Flower app of pflax (`pyproject.toml`: the `serverapp` and
  `clientapp` of the installed `pflax.flower`) into `directory`; returns it.

  Submit it to any SuperLink with `flwr run DIRECTORY CONNECTION --run-config
  RUN_TOML` (see `write_run_config`); every SuperNode needs pflax installed.
  """
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "pyproject.toml"), "w", encoding="utf-8") as f:
    f.write(_APP_PYPROJECT)
  return directory


def write_run_config(path: str, experiment: flower.Experiment, out: str = "",
                     timeout: float = 600.0) -> str:
  """Writes the run config of `flwr run --run-config PATH` for `experiment`;
  returns `path`.

  Args:
    path: the TOML file to write.
    experiment: the algorithm, configuration and seed the server runs.
    out: where the server writes `results.json` after every round ("": not).
    timeout: seconds the server waits for a round's replies.
  """
  with open(path, "w", encoding="utf-8") as f:
    f.write(f"experiment = {json.dumps(experiment.to_json())}\n"
            f"out = {json.dumps(out)}\ntimeout = {float(timeout)}\n")
  return path


def free_port() -> int:
  """A TCP port on the loopback address that is free now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((LOOPBACK, 0))
    return s.getsockname()[1]


def _wait_for_port(port: int, process: subprocess.Popen, log: str,
                   timeout: float) -> None:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if process.poll() is not None:
      raise RuntimeError(f"{process.args[0]} exited ({process.returncode}): "
                         f"{_tail(log)}")
    with contextlib.suppress(OSError), socket.create_connection((LOOPBACK, port), 0.5):
      return
    time.sleep(0.2)
  raise RuntimeError(f"{process.args[0]} did not listen on {LOOPBACK}:{port} within "
                     f"{timeout} s: {_tail(log)}")


def _tail(path: str, lines: int = 15) -> str:
  try:
    with open(path, encoding="utf-8", errors="replace") as f:
      return "".join(f.readlines()[-lines:])
  except OSError:
    return ""


def _executable(name: str) -> str:
  """A Flower command of this Python's environment."""
  here = os.path.join(os.path.dirname(sys.executable), name)
  return here if os.path.exists(here) else (shutil.which(name) or name)


class LocalFederation:
  """A SuperLink and `num_nodes` SuperNodes on 127.0.0.1 (a context manager).

  Args:
    num_nodes: SuperNodes, node i with `partition-id=i` (one per client).
    workdir: a directory for the Flower home, the app, the logs (default: a
      temporary one, removed on exit).
    env: extra environment variables of every process (e.g. JAX's cache).
    simulation: Flower's simulation engine instead of SuperNode processes.
    cpus_per_client: with `simulation`, CPUs Ray reserves per client app (so
      how many clients train at once).
  """

  def __init__(self, num_nodes: int, workdir: str | None = None,
               env: Mapping[str, str] | None = None, simulation: bool = False,
               cpus_per_client: int = 1):
    if num_nodes < 1:
      raise ValueError(f"num_nodes must be >= 1, got {num_nodes}.")
    if cpus_per_client < 1:
      raise ValueError(f"cpus_per_client must be >= 1, got {cpus_per_client}.")
    self.num_nodes = num_nodes
    self.simulation = simulation
    self.cpus_per_client = cpus_per_client
    self._own_workdir = workdir is None
    self.workdir = workdir or tempfile.mkdtemp(prefix="pflax-flower-")
    self.env = {**os.environ, **QUIET, **(env or {}),
                "FLWR_HOME": os.path.join(self.workdir, "flwr-home")}
    self.superlink: subprocess.Popen | None = None
    self.supernodes: list[subprocess.Popen] = []
    self.port = 0

  def _log(self, name: str) -> str:
    return os.path.join(self.workdir, f"{name}.log")

  def _start(self, name: str, args: list[str]) -> subprocess.Popen:
    with open(self._log(name), "w", encoding="utf-8") as log:
      return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                              start_new_session=True)

  def _write_files(self) -> None:
    home = self.env["FLWR_HOME"]
    os.makedirs(home, exist_ok=True)
    with open(os.path.join(home, "config.toml"), "w", encoding="utf-8") as f:
      f.write(f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
              f'address = "{LOOPBACK}:{self.port}"\ninsecure = true\n')

    write_app(self.app_dir)

  def _federation_config(self) -> list[str]:
    """`flwr run`'s simulation options (none for a deployment)."""
    if not self.simulation:
      return []
    return ["--federation-config", f"num-supernodes={self.num_nodes} "
            f"client-resources-num-cpus={self.cpus_per_client} "
            "client-resources-num-gpus=0.0"]

  @property
  def app_dir(self) -> str:
    return os.path.join(self.workdir, "app")

  def __enter__(self) -> "LocalFederation":
    try:
      self.port = free_port()
      self._write_files()
      self.superlink = self._start("superlink", [
          _executable("flower-superlink"), "--insecure", "--host", LOOPBACK, "--port",
          str(self.port), "--disable-runtime-dependency-installation",
          *(["--simulation"] if self.simulation else [])])
      _wait_for_port(self.port, self.superlink, self._log("superlink"), 60.0)
      for i in range(0 if self.simulation else self.num_nodes):
        port = free_port()
        node = self._start(f"supernode-{i}", [
            _executable("flower-supernode"), "--insecure", "--superlink",
            f"{LOOPBACK}:{self.port}", "--host", LOOPBACK, "--port", str(port),
            "--node-config", f"partition-id={i} num-partitions={self.num_nodes}"])
        self.supernodes.append(node)
        _wait_for_port(port, node, self._log(f"supernode-{i}"), 60.0)
    except BaseException:
      self.close()
      raise
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  def kill_node(self, i: int) -> None:
    """Kills SuperNode i and its ClientApp processes at once (SIGKILL)."""
    with contextlib.suppress(ProcessLookupError):
      os.killpg(self.supernodes[i].pid, signal.SIGKILL)

  def close(self) -> None:
    """Stops every process (SIGTERM, then SIGKILL) and removes a temporary workdir."""
    processes = [p for p in [*self.supernodes, self.superlink] if p is not None]
    for p in processes:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGTERM)
    for p in processes:
      try:
        p.wait(10)
      except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
          os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    self.supernodes, self.superlink = [], None
    if self._own_workdir:
      shutil.rmtree(self.workdir, ignore_errors=True)

  def run(self, experiment: flower.Experiment, out: str, timeout: float = 600.0,
          on_round: Callable[[int], None] | None = None) -> records.Results:
    """Runs `experiment` in the federation (`flwr run`); its results, also in
    `out/results.json`.

    Args:
      experiment: what to run; `experiment.config.clients` must be `num_nodes`.
      out: the directory of `results.json` (written after every round).
      timeout: seconds the server waits for the clients' replies of a round.
      on_round: called with the number of rounds done whenever it grows.

    Raises:
      RuntimeError: the run did not finish all its rounds (with the end of the
        server's log).
    """
    if experiment.config.clients != self.num_nodes:
      raise ValueError(f"the experiment has clients={experiment.config.clients}, the "
                       f"federation {self.num_nodes} nodes.")
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "results.json")
    with contextlib.suppress(FileNotFoundError):
      os.remove(path)
    run_config = write_run_config(os.path.join(self.workdir, "run.toml"), experiment,
                                  out, timeout)
    log = self._log(f"run-{experiment.algorithm.replace(':', '-')}")
    with open(log, "w", encoding="utf-8") as f:
      submit = subprocess.Popen(
          [_executable("flwr"), "run", self.app_dir, CONNECTION, "--stream",
           "--run-config", run_config, *self._federation_config()], stdout=f, stderr=subprocess.STDOUT,
          env=self.env, start_new_session=True)
      try:
        _follow(submit, path, on_round)
      finally:
        with contextlib.suppress(ProcessLookupError):
          os.killpg(submit.pid, signal.SIGTERM)
        submit.wait()
    results = _rounds_done(path)[1]
    if results is None or len(results.runs[0].history) < experiment.config.rounds:
      raise RuntimeError(f"the Flower run of {experiment.algorithm} did not finish; "
                         f"the end of its log ({log}):\n{_tail(log, 25)}")
    return results


def _rounds_done(path: str) -> tuple[int, records.Results | None]:
  """`(rounds, results)` of a run's `results.json` so far ((0, None): none yet)."""
  try:
    results = records.Results.load(path)
  except (OSError, ValueError, KeyError):
    return 0, None
  return len(results.runs[0].history), results


def _follow(process: subprocess.Popen, path: str,
            on_round: Callable[[int], None] | None) -> None:
  """Waits for `process`, reporting the rounds written to `path` as they grow."""
  done = 0
  while True:
    finished = process.poll() is not None
    rounds = _rounds_done(path)[0] if on_round else 0
    if rounds > done:
      done = rounds
      on_round(done)
    if finished:
      return
    time.sleep(0.5)
