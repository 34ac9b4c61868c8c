"""A Flower federation on this machine, running pflax's `serverapp` and
`clientapp` (`pflax-run --flower`).

`LocalFederation` starts Flower's deployment engine: one `flower-superlink` and
one `flower-supernode` per client (node config `partition-id=i`), each a
process listening on the loopback address only, with a Flower home of its own
(never the user's `~/.flwr`). With `simulation=True` it starts a SuperLink
with Flower's simulation engine instead (the clients are Ray actors of that
SuperLink; no SuperNode processes). `run` submits an experiment with
`flwr run` and returns its `results.json`.

A private network by default: every process of the federation runs in a user
and network namespace of its own (`unshare --user --map-root-user --net`,
entered with `nsenter`; Linux, no privilege needed where the kernel allows
unprivileged user namespaces), whose loopback interface no other process
of the machine can reach. That is what authenticates whoever connects to
the Control, Fleet, ServerAppIo and ClientAppIo APIs, which Flower 1.42's
open-source release does not (a client that skips certificate verification
is served by the Control API; a SuperNode's runtime API takes anyone's task
runner): only a process pflax started, or one its user starts with
`nsenter` into the namespace (`LocalFederation.inside`), can connect. Where
the namespace cannot be made, `isolate=None` warns and falls back to the
host's loopback, `isolate=True` refuses to start. See docs/flower-security.md.

TLS and SuperNode authentication too: the SuperLink speaks TLS only,
with a certificate of a certificate authority made for this federation, and
admits only SuperNodes whose keys pflax generated and registered
(`--enable-supernode-auth`). Certificates, keys and the Flower home lie in a
private (0700) directory, removed on every exit (SIGKILL of this process
included: the watchdog).

No orphans: every process is started in a process group of its own, killed
(SIGKILL) by the kernel if the Python process that started it dies
(`PR_SET_PDEATHSIG` on Linux), and stopped on exit; a watchdog process kills
what Flower started from them (marked by an environment variable) when this
process dies however it dies (`flower_guard`). Flower's telemetry and update
check are off in every process.

Memory: a deployment takes about `DEPLOYMENT_FIXED` for the SuperLink side and
`DEPLOYMENT_PER_CLIENT` for each SuperNode side (`deployment_memory`);
`LocalFederation` refuses to start one that would not fit in the machine's
available memory (`check_memory`).
"""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from pflax._src.flower import experiment as experiment_lib
from pflax._src.flower import guard as flower_guard
from pflax._src.flower import keys as flower_keys
from pflax._src.simulation import records

LOOPBACK = "127.0.0.1"
CONNECTION = "pflax-local"
QUIET = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
"""Flower's environment switches for no telemetry and no update check."""

RESTART_PAUSE = 5.0
"""Seconds between `LocalFederation.restart_node`'s attempts."""

_MIB = 2**20
DEPLOYMENT_FIXED = 900 * _MIB
"""Peak resident memory of a deployment's fixed part: the SuperLink, its
SuperExec and the ServerApp (664 MiB together) and `flwr run` (232 MiB); not
the process that starts the federation, already running when it is checked.

Measured (peak VmRSS of every process of the federation, sampled every 0.1 s)
on a `pflax-run --flower --algorithms fedavg --clients 4 --rounds 1
--local-epochs 1 --model mlp` run: JAX 0.10.2 on CPU (jaxlib CPU build),
Flower 1.42, Linux x86-64.
"""
DEPLOYMENT_PER_CLIENT = 600 * _MIB
"""Peak resident memory of one client of a deployment: its SuperNode (138
MiB), the SuperNode's SuperExec (126 MiB) and the ClientApp process it starts
for each message (at most 331 MiB: JAX, pflax, the client's data and model);
595 MiB together at the peak, the same for each of 2 and 4 clients. Measured as
`DEPLOYMENT_FIXED` (digits' MLP); a larger model or dataset adds its share."""


def deployment_memory(num_clients: int) -> int:
  """Bytes a local deployment of `num_clients` clients takes at its peak, about:
  `DEPLOYMENT_FIXED + num_clients * DEPLOYMENT_PER_CLIENT` (both measured)."""
  return DEPLOYMENT_FIXED + num_clients * DEPLOYMENT_PER_CLIENT


def available_memory() -> int | None:
  """`MemAvailable` of `/proc/meminfo` in bytes (None where there is none)."""
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return None


def check_memory(num_clients: int, available: int | None) -> None:
  """Raises a one-line RuntimeError if a deployment of `num_clients` clients
  (`deployment_memory`) needs more than `available` bytes (None: no check)."""
  needed = deployment_memory(num_clients)
  if available is not None and needed > available:
    raise RuntimeError(
        f"a Flower deployment of {num_clients} clients needs about "
        f"{needed / 2**30:.1f} GiB ({DEPLOYMENT_FIXED // _MIB} MiB + {num_clients} x "
        f"{DEPLOYMENT_PER_CLIENT // _MIB} MiB per client), more than the "
        f"{available / 2**30:.1f} GiB available; use Flower's simulation engine "
        "(--flower simulation, LocalFederation(simulation=True)) or fewer clients")

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
serverapp = "pflax._src.flower.apps:serverapp"
clientapp = "pflax._src.flower.apps:clientapp"

[tool.flwr.app.config]
experiment = "{}"
out = ""
timeout = 600.0
"""


def write_app(directory: str) -> str:
  """Writes the Flower app of pflax (`pyproject.toml`: the `serverapp` and
  `clientapp` of the installed pflax, in `pflax._src.flower.apps`) into
  `directory`; returns it.

  Submit it to any SuperLink with `flwr run DIRECTORY CONNECTION --run-config
  RUN_TOML` (see `write_run_config`); every SuperNode needs pflax installed.
  """
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "pyproject.toml"), "w", encoding="utf-8") as f:
    f.write(_APP_PYPROJECT)
  return directory


def write_run_config(path: str, experiment: experiment_lib.Experiment,
                     out: str = "", timeout: float = 600.0) -> str:
  """Writes the run config of `flwr run --run-config PATH` for `experiment`;
  returns `path`.

  Args:
    path: the TOML file to write.
    experiment: the algorithm, configuration and seed the server runs.
    out: where the server writes `results.json` after every round ("": not).
    timeout: seconds the server waits for a round's replies.

  Raises:
    ValueError: for an experiment whose model or parts are Python objects
      (they travel as `"module:attr"` import strings only).
  """
  experiment.check_travels()
  with open(path, "w", encoding="utf-8") as f:
    f.write(f"experiment = {json.dumps(experiment.to_json())}\n"
            f"out = {json.dumps(out)}\ntimeout = {float(timeout)}\n")
  return path


def free_port() -> int:
  """A TCP port on the loopback address that is free now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((LOOPBACK, 0))
    return s.getsockname()[1]


class PrivateNetwork:
  """A user and network namespace of its own, held by a process (`flower_guard.py
  hold`) that ends when this process closes its pipe or dies.

  `enter + command` runs `command` in it; `listening(port)` asks the holder
  whether something listens on the namespace's `LOOPBACK:port`.
  """

  def __init__(self, holder: subprocess.Popen):
    self.holder = holder
    self.enter = [shutil.which("nsenter") or "nsenter", f"--target={holder.pid}",
                  "--user", "--net", "--preserve-credentials", "--"]

  def listening(self, port: int) -> bool:
    self.holder.stdin.write(f"{port}\n")
    self.holder.stdin.flush()
    return self.holder.stdout.readline().strip() == "1"

  def close(self) -> None:
    with contextlib.suppress(OSError):
      self.holder.stdin.close()
    _stop([self.holder], 5.0)


def private_network(env: Mapping[str, str]) -> PrivateNetwork | None:
  """A new `PrivateNetwork` (its holder with the environment `env`), or None
  where the system cannot make one (not Linux, no `unshare`/`nsenter`, or
  unprivileged user namespaces disabled)."""
  unshare = shutil.which("unshare")
  if not sys.platform.startswith("linux") or not unshare or not shutil.which("nsenter"):
    return None
  holder = subprocess.Popen(
      [unshare, "--user", "--map-root-user", "--net", "--", sys.executable, "-I",
       flower_guard.__file__, "hold"],
      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
      text=True, env=dict(env), start_new_session=True)
  if holder.stdout.readline().strip() != "ready":
    _stop([holder], 0.0)
    return None
  return PrivateNetwork(holder)


def _wait_for_port(port: int, process: subprocess.Popen, log: str,
                   timeout: float, listening: Callable[[int], bool]) -> None:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if process.poll() is not None:
      raise RuntimeError(f"{_name(process)} exited ({process.returncode}): "
                         f"{_tail(log)}")
    if listening(port):
      return
    time.sleep(0.2)
  raise RuntimeError(f"{_name(process)} did not listen on {LOOPBACK}:{port} within "
                     f"{timeout} s: {_tail(log)}")


def _activated(node: subprocess.Popen, log: str, offset: int, deadline: float
               ) -> bool:
  """Whether the SuperNode `node` was accepted by the SuperLink (its log, past
  `offset`, names its node id) before it exited or `deadline` passed."""
  while time.monotonic() < deadline and node.poll() is None:
    with open(log, encoding="utf-8", errors="replace") as f:
      f.seek(offset)
      if "SuperNode ID:" in f.read():
        return True
    time.sleep(0.5)
  return False


def _name(process: subprocess.Popen) -> str:
  """The command that `_popen` started."""
  return os.path.basename(process.args[process.args.index("exec") + 2])


def _tail(path: str, lines: int = 15) -> str:
  try:
    with open(path, encoding="utf-8", errors="replace") as f:
      return "".join(f.readlines()[-lines:])
  except OSError:
    return ""


def _executable(name: str) -> str:
  """A Flower command of this Python's environment (beside `sys.executable`,
  whether or not that directory is on PATH), else of PATH."""
  here = os.path.join(os.path.dirname(sys.executable), name)
  return here if os.access(here, os.X_OK) else (shutil.which(name) or name)


def _popen(args: list[str], log: str, env: Mapping[str, str],
           enter: list[str] | None = None) -> subprocess.Popen:
  """Starts `args` in a process group of its own that the kernel kills if this
  process dies (`flower_guard.py exec`), its output appended to the file `log`;
  in a `PrivateNetwork` when `enter` is its `enter`."""
  fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
               0o600)
  with open(fd, "a", encoding="utf-8") as f:
    return subprocess.Popen([*(enter or []), sys.executable, "-I",
                             flower_guard.__file__, "exec", str(os.getpid()), *args],
                            stdout=f, stderr=subprocess.STDOUT, env=env,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def _own_folder(path: str) -> None:
  """Makes the folder `path`, a symlink there replaced by a real folder (never
  followed: the logs of a federation go where asked, not where someone else's
  link points)."""
  if os.path.islink(path):
    os.remove(path)
  os.makedirs(path, exist_ok=True)


def _stop(processes: list[subprocess.Popen], grace: float = 10.0) -> None:
  """Stops the process groups of `processes`: SIGTERM, then SIGKILL after `grace`
  seconds, and SIGKILL to what is left of each group."""
  for p in processes:
    with contextlib.suppress(ProcessLookupError):
      os.killpg(p.pid, signal.SIGTERM)
      os.killpg(p.pid, signal.SIGCONT)  # a stopped (hung) group handles it
  deadline = time.monotonic() + grace
  for p in processes:
    with contextlib.suppress(subprocess.TimeoutExpired):
      p.wait(max(deadline - time.monotonic(), 0.0))
    with contextlib.suppress(ProcessLookupError):
      os.killpg(p.pid, signal.SIGKILL)
    p.wait()


class LocalFederation:
  """A SuperLink and `num_nodes` SuperNodes on 127.0.0.1 (a context manager).

  Args:
    num_nodes: SuperNodes, node i with `partition-id=i` (one per client).
    workdir: a directory for the Flower home, the credentials, the app
      (default: a temporary one, removed on exit).
    env: extra environment variables of every process (e.g. JAX's cache).
    simulation: Flower's simulation engine instead of SuperNode processes.
    cpus_per_client: with `simulation`, CPUs Ray reserves per client app (so
      how many clients train at once).
    insecure: no TLS and no SuperNode authentication (a warning): any process
      that can reach the port can use the SuperLink.
    log_dir: where the processes' logs are written and kept (default:
      `workdir`).
    node_env: `{i: variables}`, extra environment variables of SuperNode i's
      processes only (its SuperExec and ClientApps inherit them), over `env`:
      e.g. another `PYTHONPATH` for one node (a node running other code).
    isolate: run every process in a `PrivateNetwork`, which no other process
      of the machine can reach: None (default) where the system allows it,
      else a warning and the host's loopback; True: refuse to start without;
      False: the host's loopback.

  Raises (on entry):
    RuntimeError: a deployment (not `simulation`) would need more memory than
      the machine has available (`check_memory`), before starting anything;
      `isolate=True` and no `PrivateNetwork` can be made.
  """

  def __init__(self, num_nodes: int, workdir: str | None = None,
               env: Mapping[str, str] | None = None, simulation: bool = False,
               cpus_per_client: int = 1, insecure: bool = False,
               log_dir: str | None = None,
               node_env: Mapping[int, Mapping[str, str]] | None = None,
               isolate: bool | None = None):
    if num_nodes < 1:
      raise ValueError(f"num_nodes must be >= 1, got {num_nodes}.")
    if cpus_per_client < 1:
      raise ValueError(f"cpus_per_client must be >= 1, got {cpus_per_client}.")
    if node_env and simulation:
      raise ValueError("node_env is for a deployment's SuperNodes: the simulation "
                       "engine has none.")
    if node_env and not set(node_env) <= set(range(num_nodes)):
      raise ValueError(f"node_env's keys must be nodes in [0, {num_nodes}), got "
                       f"{sorted(node_env)}.")
    if insecure:
      warnings.warn("LocalFederation(insecure=True): the SuperLink runs without TLS "
                    "or SuperNode authentication; any process that can reach its "
                    "port can list, submit and stop runs and join as a node.",
                    stacklevel=2)
    self.num_nodes = num_nodes
    self.simulation = simulation
    self.cpus_per_client = cpus_per_client
    self.insecure = insecure
    self._own_workdir = workdir is None
    self._token = os.urandom(16).hex()
    self.workdir = workdir or tempfile.mkdtemp(prefix="pflax-flower-")
    self.log_dir = log_dir or self.workdir
    bin_dir = os.path.dirname(sys.executable)
    self.env = {**os.environ, **QUIET, **(env or {}),
                "FLWR_HOME": os.path.join(self.workdir, "flwr-home"),
                flower_guard.VARIABLE: self._token,
                # Flower starts `flower-superexec` from PATH.
                "PATH": os.pathsep.join(p for p in (bin_dir, os.environ.get("PATH"))
                                        if p)}
    self.node_env = {i: dict(v) for i, v in (node_env or {}).items()}
    self.superlink: subprocess.Popen | None = None
    self.supernodes: list[subprocess.Popen] = []
    self._node_args: list[list[str]] = []
    self.port = 0
    self._runs = 0
    self._watchdog: subprocess.Popen | None = None
    self.isolate = isolate
    self.network: PrivateNetwork | None = None
    self.node_ports: list[int] = []

  @property
  def isolated(self) -> bool:
    """Whether the federation runs in a `PrivateNetwork`."""
    return self.network is not None

  def inside(self, command: list[str]) -> list[str]:
    """`command` run in the federation's network (as is when not isolated): e.g.
    `subprocess.run(federation.inside(["flwr", "ls"]), env=federation.env)`."""
    return [*(self.network.enter if self.network else []), *command]

  def _listening(self, port: int) -> bool:
    return (self.network.listening(port) if self.network
            else flower_guard.listening(port))

  def _open_network(self) -> None:
    """Makes the `PrivateNetwork` as `isolate` asks (before any process)."""
    if self.isolate is False:
      return
    self.network = private_network(self.env)
    if self.network is not None:
      return
    why = ("no private network namespace could be made here (Linux with "
           "unprivileged user namespaces, and util-linux's unshare and nsenter, "
           "are needed)")
    if self.isolate:
      raise RuntimeError(f"LocalFederation(isolate=True): {why}.")
    warnings.warn(f"LocalFederation: {why}; the federation listens on the host's "
                  "loopback, where any local process can reach its ports "
                  "(docs/flower-security.md).", stacklevel=3)

  def _log(self, name: str) -> str:
    return os.path.join(self.log_dir, f"{name}.log")

  def _new_log(self, name: str) -> str:
    """`_log(name)`, whatever was there removed (a symlink planted there
    included: the log is created, never written through it)."""
    log = self._log(name)
    with contextlib.suppress(FileNotFoundError):
      os.remove(log)
    return log

  def _start(self, name: str, args: list[str], log: str | None = None,
             env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """Starts `args`, logging to `name`.log (a new one) or to `log`, with
    `self.env` updated with `env`; the first call starts the watchdog that kills
    the federation if this process dies."""
    if log is None:
      log = self._new_log(name)
    if self._watchdog is None:  # kills what is left if this process dies
      self._watchdog = subprocess.Popen(
          [sys.executable, "-I", flower_guard.__file__, "watch", self._token,
           *self._secrets()],
          stdin=subprocess.PIPE, text=True, start_new_session=True)
    return _popen(args, log, {**self.env, **(env or {}),
                              flower_guard.VARIABLE: self._token},
                  self.network.enter if self.network else None)

  def _secrets(self) -> list[str]:
    """What is removed on every exit, SIGKILL included: a temporary workdir
    whole, else the Flower home's certificates and node keys."""
    if self._own_workdir:
      return [self.workdir]
    return [os.path.join(self.home, "tls"), os.path.join(self.home, "keys")]

  @property
  def home(self) -> str:
    """The Flower home of every process (private: mode 0700)."""
    return self.env["FLWR_HOME"]

  @property
  def app_dir(self) -> str:
    return os.path.join(self.workdir, "app")

  def _write_files(self) -> flower_keys.Certificates | None:
    """The Flower home's `config.toml`, the app, and (unless insecure) the
    SuperLink's certificates."""
    flower_keys.private_directory(self.home)
    _own_folder(self.log_dir)
    certificates = (None if self.insecure else flower_keys.write_certificates(
        os.path.join(self.home, "tls")))
    tls = ("insecure = true" if certificates is None
           else f"root-certificates = {json.dumps(certificates.ca)}")
    with open(os.path.join(self.home, "config.toml"), "w", encoding="utf-8") as f:
      f.write(f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
              f'address = "{LOOPBACK}:{self.port}"\n{tls}\n')
    write_app(self.app_dir)
    return certificates

  def _register(self, keys: list[flower_keys.NodeKey]) -> None:
    """Registers the SuperNodes' public keys with the SuperLink."""
    log = self._new_log("register")
    registering = [self._start("", [_executable("flwr"), "supernode", "register",
                                    k.public, CONNECTION], log) for k in keys]
    try:
      failed = [p.wait(120) for p in registering]
    except subprocess.TimeoutExpired:
      failed = [1]
    finally:
      _stop(registering, 0.0)
    if any(failed):
      raise RuntimeError(f"registering the SuperNodes' keys failed: {_tail(log)}")

  def _federation_config(self) -> list[str]:
    """`flwr run`'s simulation options (none for a deployment)."""
    if not self.simulation:
      return []
    return ["--federation-config", f"num-supernodes={self.num_nodes} "
            f"client-resources-num-cpus={self.cpus_per_client} "
            "client-resources-num-gpus=0.0"]

  def __enter__(self) -> "LocalFederation":
    try:
      if not self.simulation:
        check_memory(self.num_nodes, available_memory())
      self._open_network()
      self.port = free_port()
      certificates = self._write_files()
      tls = ["--insecure"] if certificates is None else [
          "--ssl-ca-certfile", certificates.ca, "--ssl-certfile", certificates.cert,
          "--ssl-keyfile", certificates.key]
      auth = [] if self.simulation or self.insecure else ["--enable-supernode-auth"]
      self.superlink = self._start("superlink", [
          _executable("flower-superlink"), *tls, *auth, "--host", LOOPBACK,
          "--port", str(self.port), "--disable-runtime-dependency-installation",
          *(["--simulation"] if self.simulation else [])])
      _wait_for_port(self.port, self.superlink, self._log("superlink"), 60.0,
                     self._listening)
      if not self.simulation:
        self._start_nodes(certificates)
    except BaseException:
      self.close()
      raise
    return self

  def _start_nodes(self, certificates: flower_keys.Certificates | None) -> None:
    keys = [flower_keys.write_node_key(os.path.join(self.home, "keys"), f"node-{i}")
            for i in range(self.num_nodes)]
    if certificates is not None:
      self._register(keys)
    for i, key in enumerate(keys):
      tls = ["--insecure"] if certificates is None else [
          "--root-certificates", certificates.ca,
          "--auth-supernode-private-key", key.private]
      self._node_args.append([
          _executable("flower-supernode"), *tls, "--superlink",
          f"{LOOPBACK}:{self.port}", "--host", LOOPBACK,
          "--node-config", f"partition-id={i} num-partitions={self.num_nodes}"])
      node, port = self._spawn_node(i)
      self.supernodes.append(node)
      _wait_for_port(port, node, self._log(f"supernode-{i}"), 60.0, self._listening)

  def _spawn_node(self, i: int, log: str | None = None) -> tuple[subprocess.Popen, int]:
    """Starts SuperNode i (its key, if any, as before) on a new port: `(process,
    port)`. `log`: append to that file rather than a new one."""
    port = free_port()
    node = self._start(f"supernode-{i}", [*self._node_args[i], "--port", str(port)],
                       log, env=self.node_env.get(i))
    self.node_ports[i:i + 1] = [port]
    return node, port

  def __exit__(self, *exc: Any) -> None:
    self.close()

  def kill_node(self, i: int) -> None:
    """Kills SuperNode i and its ClientApp processes at once (SIGKILL)."""
    with contextlib.suppress(ProcessLookupError):
      os.killpg(self.supernodes[i].pid, signal.SIGKILL)
    self.supernodes[i].wait()

  def restart_node(self, i: int, within: float = 120.0) -> None:
    """Kills SuperNode i (`kill_node`) and starts it again with its key, its
    log continued, until the SuperLink accepts it.

    Flower 1.42 refuses the key while the killed node is online for the
    SuperLink, up to 60 s after its last heartbeat (a 30 s interval, 2 missed):
    the new SuperNode exits ("Failed to activate SuperNode", exit code 305), and
    it is started again every `RESTART_PAUSE` seconds.

    Raises:
      RuntimeError: the SuperLink did not accept it within `within` seconds.
    """
    self.kill_node(i)
    log = self._log(f"supernode-{i}")
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
      offset = os.path.getsize(log)
      node, _ = self._spawn_node(i, log)
      self.supernodes[i] = node
      if _activated(node, log, offset, deadline):
        return
      time.sleep(RESTART_PAUSE)
    raise RuntimeError(f"SuperNode {i} was not accepted again within {within} s: "
                       f"{_tail(log)}")

  def hang_node(self, i: int, hang: bool = True) -> None:
    """Stops SuperNode i and its ClientApp processes (SIGSTOP: a node that hangs,
    still connected for the SuperLink until its heartbeats are missed), or
    lets them go on (`hang=False`: SIGCONT)."""
    with contextlib.suppress(ProcessLookupError):
      os.killpg(self.supernodes[i].pid, signal.SIGSTOP if hang else signal.SIGCONT)

  def close(self) -> None:
    """Stops every process (SIGTERM, then SIGKILL) and removes a temporary
    workdir (the logs stay in `log_dir` when it is another directory), or the
    certificates and node keys of a given one (`_secrets`); if this process
    dies without closing (even by SIGKILL), the watchdog does both."""
    _stop([p for p in [*self.supernodes, self.superlink] if p is not None])
    self.supernodes, self.superlink = [], None
    flower_guard.sweep(self._token)  # what Flower started outside the groups
    if self.network is not None:
      self.network.close()
      self.network = None
    if self._watchdog is not None:
      with contextlib.suppress(OSError):
        self._watchdog.stdin.write("done\n")
        self._watchdog.stdin.close()
      self._watchdog.wait()
      self._watchdog = None
    for path in self._secrets():
      shutil.rmtree(path, ignore_errors=True)

  def run(self, experiment: experiment_lib.Experiment, out: str,
          timeout: float = 600.0, on_round: Callable[[int], None] | None = None
          ) -> records.Results:
    """Runs `experiment` in the federation (`flwr run`); its results, also in
    `out/results.json`.

    Args:
      experiment: what to run; `experiment.config.clients` must be `num_nodes`.
      out: the directory of `results.json` (written after every round).
      timeout: seconds the server waits for the clients' replies of a round.
      on_round: called with the number of rounds done whenever it grows.

    Raises:
      RuntimeError: the run did not finish all its rounds: its first line
        names the server's error, if it raised one (`_server_error`), its
        results so far and the logs; the end of the run's log follows.
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
    self._runs += 1
    log = self._new_log(f"run-{self._runs}-{experiment.algorithm.replace(':', '-')}")
    submit = self._start("", [_executable("flwr"), "run", self.app_dir, CONNECTION,
                                "--stream", "--run-config", run_config,
                                *self._federation_config()], log)
    try:
      _follow(submit, path, on_round)
    finally:
      _stop([submit])
    results = _rounds_done(path)[1]
    if results is None or len(results.runs[0].history) < experiment.config.rounds:
      why = _server_error(log)
      raise RuntimeError(f"the Flower run of {experiment.algorithm} "
                         f"{f'stopped: {why}' if why else 'did not finish'} (its "
                         f"results so far: {path}; the federation's logs: "
                         f"{self.log_dir}); the end of {log}:\n{_tail(log, 25)}")
    return results


_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception): ")


def _server_error(log: str) -> str | None:
  """The last exception of a run's log as one line (`RuntimeError: why`), if
  the ServerApp raised one."""
  errors = [line.strip() for line in _tail(log, 200).splitlines()
            if _EXCEPTION.match(line)]
  return errors[-1] if errors else None


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
