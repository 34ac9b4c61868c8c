"""A Flower federation of pflax on this machine against outsiders, and its end
(slow): the federation runs in a private network namespace, so a process of
the machine that knows its ports, verifying the certificate or not (a raw
HTTPS request that skips verification, Flower's CLI, a SuperNode, a task
runner on a node's runtime API, a 64 MiB request), reaches none of them, and
another user cannot enter the namespace; a process in the namespace without
pflax's CA or a registered key can neither list, submit nor stop runs, nor
join as a SuperNode; SIGTERM or SIGKILL of `pflax-run --flower` leaves no
process and no key folder; `pflax-run --flower` finds Flower beside its
Python when that is not on PATH."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("flwr")

from pflax import flower  # pylint: disable=wrong-import-position
from pflax._src.flower import deploy as flower_deploy  # pylint: disable=wrong-import-position
from pflax._src.flower import guard as flower_guard  # pylint: disable=wrong-import-position
import processes  # pylint: disable=wrong-import-position
from pflax._src.flower import keys as flower_keys  # pylint: disable=wrong-import-position

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("flower_security")]

BIN = os.path.dirname(sys.executable)
QUIET = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}


@pytest.fixture(scope="module")
def federation():
  with flower.LocalFederation(2) as f:   # isolated where the system allows it
    yield f


def _isolated(federation):  # pylint: disable=redefined-outer-name
  if not federation.isolated:
    pytest.skip("no private network namespace on this machine")


@pytest.fixture
def rogue(federation, tmp_path):
  """The environment of an outsider: its own Flower home, with connections to
  the port without TLS ("plain") and with TLS but not pflax's CA ("tls")."""
  home = tmp_path / "rogue-home"
  home.mkdir()
  address = f"127.0.0.1:{federation.port}"
  (home / "config.toml").write_text(
      f'[superlink]\ndefault = "plain"\n\n[superlink.plain]\naddress = "{address}"\n'
      f'insecure = true\n\n[superlink.tls]\naddress = "{address}"\n')
  return {**os.environ, **QUIET, "FLWR_HOME": str(home),
          "PATH": os.pathsep.join([BIN, os.environ.get("PATH", "")])}


def _flwr(env, *args, inside=None):
  """Flower's CLI, in the network of the federation `inside` (else the host's)."""
  command = [os.path.join(BIN, "flwr"), *args]
  return subprocess.run(inside.inside(command) if inside else command, env=env,
                        text=True, capture_output=True, timeout=90, check=False)


def _json(env, *args, inside=None):
  done = _flwr(env, *args, "--format", "json", inside=inside)
  assert done.returncode == 0, done.stdout + done.stderr
  return json.loads(done.stdout)


@pytest.mark.parametrize("where", ["host", "namespace"])
@pytest.mark.parametrize("connection", ["plain", "tls"])
def test_an_outsider_can_neither_list_nor_submit_nor_stop(federation, rogue,
                                                           connection, where):
  """From the host (the federation isolated) or from inside its network (as if
  isolation were broken), without pflax's CA."""
  if where == "host":
    _isolated(federation)
  inside = federation if where == "namespace" else None
  for command in (["ls"], ["run", federation.app_dir], ["stop", "1"]):
    done = _flwr(rogue, *command, connection, inside=inside)
    assert done.returncode != 0, (command, done.stdout)
    assert "unavailable" in done.stdout + done.stderr, (command, done.stdout)
  assert _json(federation.env, "ls", inside=federation)["runs"] == []  # none submitted


_REQUEST = """\
import http.client, ssl, sys
port, path, size = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
context = ssl._create_unverified_context()  # skips certificate verification
for connection in (http.client.HTTPSConnection('127.0.0.1', port, timeout=30,
                                               context=context),
                   http.client.HTTPConnection('127.0.0.1', port, timeout=30)):
  try:
    connection.request('POST', path, body=b'\\0' * size,
                       headers={'Content-Type': 'application/protobuf'})
    print('served', connection.getresponse().status)
  except OSError as error:
    print('refused', type(error).__name__)
"""


def _request(port, path, size=0, user=None):
  """What a raw HTTP(S) POST of `size` bytes to 127.0.0.1:port gets, from the
  host's network (as `user`, if given), TLS verification skipped: a line per
  attempt (TLS, then plain), "served STATUS" or "refused ERROR"."""
  python = sys.executable if user is None else _python_of(user)
  done = subprocess.run([python, "-I", "-c", _REQUEST, str(port), path, str(size)],
                        capture_output=True, text=True, timeout=90, check=False,
                        user=user)
  assert done.returncode == 0, done.stderr
  return done.stdout.split("\n")[:-1]


def _python_of(user):
  """A Python that `user` can run (the system's), or None."""
  for python in ("/usr/bin/python3", "/usr/local/bin/python3"):
    with contextlib.suppress(OSError, subprocess.SubprocessError):
      if subprocess.run([python, "-I", "-c", "0"], user=user, capture_output=True,
                        timeout=30, check=False).returncode == 0:
        return python
  return None


def _users():
  """Who the outsider runs as: this user, and `nobody` when this is root and
  `nobody` can run a Python."""
  return [None, "nobody"] if os.geteuid() == 0 and _python_of("nobody") else [None]


def test_no_port_of_an_isolated_federation_is_reachable_from_the_host(federation):  # pylint: disable=redefined-outer-name
  """Issue 34's findings, each from a real process of the host's network: a
  client that skips certificate verification was served by the Control API
  (`list-runs`); a task runner took a node's tasks on its runtime API
  (`pull-message`); 1 GiB requests without credentials grew the SuperLink's
  memory (here 64 MiB). Each is now refused before a byte is read, on every
  port, as root and as `nobody`."""
  _isolated(federation)
  from flwr.proto import control_pb2  # pylint: disable=import-outside-toplevel,no-name-in-module
  assert all(map(federation.network.listening, [federation.port, *federation.node_ports]))
  list_runs = control_pb2.ListRunsRequest().SerializeToString()
  attempts = [(federation.port, "/v1/control/list-runs", len(list_runs)),
              (federation.port, "/v1/control/list-runs", 64 * 2**20),
              *[(port, "/v1/clientappio/pull-message", 0)
                for port in federation.node_ports]]
  for user in _users():
    for port, path, size in attempts:
      assert _request(port, path, size, user) == [
          "refused ConnectionRefusedError"] * 2, (user, port, path)


def test_another_user_cannot_enter_the_federations_network(federation):  # pylint: disable=redefined-outer-name
  _isolated(federation)
  if os.geteuid() != 0:
    pytest.skip("needs root to act as another user")
  done = subprocess.run([*federation.network.enter, "true"], user="nobody",
                        capture_output=True, text=True, timeout=30, check=False)
  assert done.returncode != 0 and "Permission denied" in done.stderr, done.stderr


def test_an_outsider_cannot_join_as_a_supernode(federation, rogue, tmp_path):
  """Inside the federation's network (as if isolation were broken): without a
  registered key, even with pflax's CA certificate in hand, or without TLS, a
  SuperNode claiming partition 0 is not admitted."""
  ca = shutil.copy(os.path.join(federation.home, "tls", "ca.pem"), tmp_path)
  key = flower_keys.write_node_key(str(tmp_path / "keys"), "rogue")
  before = {n["node-id"] for n in _json(federation.env, "supernode", "ls",
                                        inside=federation)["nodes"]}
  attempts = {"unregistered key": ["--root-certificates", ca,
                                   "--auth-supernode-private-key", key.private],
              "no key": ["--root-certificates", ca], "no TLS": ["--insecure"]}
  logs, nodes = {}, []
  for name, flags in attempts.items():
    logs[name] = tmp_path / f"{name}.log"
    with open(logs[name], "w", encoding="utf-8") as log:
      nodes.append(subprocess.Popen(federation.inside(
          [os.path.join(BIN, "flower-supernode"), *flags, "--superlink",
           f"127.0.0.1:{federation.port}", "--port", str(flower_deploy.free_port()),
           "--node-config", "partition-id=0 num-partitions=2"]),
          env=rogue, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
  try:
    time.sleep(20)
    after = _json(federation.env, "supernode", "ls", inside=federation)["nodes"]
  finally:
    for node in nodes:
      os.killpg(node.pid, signal.SIGKILL)
      node.wait()
  assert {n["node-id"] for n in after} == before
  assert all(n["status"] == "online" for n in after)
  refusals = {"unregistered key": "Failed to activate SuperNode",
              "no key": "SuperNode authentication is enabled",
              "no TLS": "Connection attempt failed"}
  for name, log in logs.items():
    text = log.read_text()
    assert "SuperNode ID" not in text and refusals[name] in text, (name, text[-2000:])


def _descendants(pid):
  """The processes started by `pid`, recursively (Linux /proc)."""
  children = {}
  for name in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{name}/stat", encoding="utf-8") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
      continue
    children.setdefault(ppid, []).append(int(name))
  found, todo = [], [pid]
  while todo:
    for child in children.get(todo.pop(), []):
      found.append(child)
      todo.append(child)
  return found


def _cmdline(pid):
  try:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      return f.read().decode(errors="replace").split("\0")
  except OSError:
    return []


def _alive(token):
  """The processes of the federation marked `token` (zombies excluded)."""
  alive = []
  for name in os.listdir("/proc"):
    if name.isdigit() and processes.environment(name).get(flower_guard.VARIABLE) == token:
      try:
        with open(f"/proc/{name}/stat", encoding="utf-8") as f:
          if f.read().rsplit(")", 1)[1].split()[0] != "Z":
            alive.append(int(name))
      except OSError:
        continue
  return alive


def _listening(port, network=None):
  """Whether something listens on 127.0.0.1:port, in the network namespace
  that the process `network` holds (else the host's)."""
  enter = [] if network is None else ["nsenter", f"--target={network}", "--user",
                                      "--net", "--preserve-credentials", "--"]
  done = subprocess.run([*enter, sys.executable, "-I", "-c",
                         "import socket, sys\n"
                         "socket.create_connection(('127.0.0.1', int(sys.argv[1])), 1)",
                         str(port)], capture_output=True, timeout=30, check=False)
  return done.returncode == 0


def _pflax_run(tmp_path, rounds, path=None):
  env = {**os.environ, **QUIET}
  if path is not None:
    env["PATH"] = path
  return subprocess.Popen(
      [sys.executable, "-m", "pflax", "--algorithms", "cwfedavg", "--clients", "2",
       "--rounds", str(rounds), "--local-epochs", "1", "--no-progress",
       "--no-compilation-cache", "--flower", "--out", str(tmp_path / "out")],
      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      start_new_session=True)


def _wait_for_the_server_app(process, timeout=240.0):
  """The federation's token, ports, Flower home and the holder of its network
  (None: not isolated) once its ServerApp runs."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    assert process.poll() is None, process.stdout.read()
    tree = _descendants(process.pid)
    if any("flwr-serverapp" in " ".join(_cmdline(p)) for p in tree):
      token = next(filter(None, (processes.environment(p).get(flower_guard.VARIABLE)
                                 for p in tree)))
      home = next(filter(None, (processes.environment(p).get("FLWR_HOME")
                                for p in tree)))
      ports = [int(c[c.index("--port") + 1]) for c in map(_cmdline, tree)
               if "--port" in c]
      network = next((p for p in tree if [a for a in _cmdline(p) if a][-1:] == ["hold"]),
                     None)
      return token, ports, home, network
    time.sleep(0.5)
  raise AssertionError("no ServerApp started")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL],
                         ids=["SIGTERM", "SIGKILL"])
def test_killing_pflax_run_flower_leaves_no_process_and_no_port(sig, tmp_path):
  process = _pflax_run(tmp_path, rounds=100)
  try:
    token, ports, home, network = _wait_for_the_server_app(process)
    assert ports and all(_listening(port, network) for port in ports)
    assert os.path.isdir(os.path.join(home, "keys"))
    os.kill(process.pid, sig)
    output = process.communicate(timeout=40)[0]
    deadline = time.monotonic() + 5.0
    while _alive(token) and time.monotonic() < deadline:
      time.sleep(0.2)
    assert not _alive(token), [_cmdline(p) for p in _alive(token)]
    if network is None:
      assert not any(map(_listening, ports))
    # else every process of its namespace, the holder included, is gone: so is it
    while os.path.exists(home) and time.monotonic() < deadline + 10.0:
      time.sleep(0.2)
    assert not os.path.exists(os.path.dirname(home))  # the CA and node keys too
  finally:
    if process.poll() is None:
      os.killpg(process.pid, signal.SIGKILL)
  logs = tmp_path / "out" / "flower-logs"
  assert (logs / "superlink.log").exists() and (logs / "supernode-1.log").exists()
  if sig == signal.SIGTERM:
    assert process.returncode == 130, output
    assert str(logs) in output, output


@pytest.mark.extended   # minutes on 2 cores: run by hand (-m extended)
def test_pflax_run_flower_finds_flower_beside_python_without_path(tmp_path):
  path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                         if p and os.path.realpath(p) != os.path.realpath(BIN))
  process = _pflax_run(tmp_path, rounds=1, path=path)
  output = process.communicate(timeout=110)[0]
  assert process.returncode == 0, output
  results = json.loads((tmp_path / "out" / "results.json").read_text())
  assert results["config"]["flower"]["engine"] == "deployment"


def test_insecure_is_explicit_and_warns(tmp_path):
  with pytest.warns(UserWarning, match="without TLS"):
    federation = flower.LocalFederation(1, insecure=True)
  with federation:
    config = (tmp_path / "home" / "config.toml")
    config.parent.mkdir()
    config.write_text(f'[superlink.plain]\naddress = "127.0.0.1:{federation.port}"\n'
                      'insecure = true\n')
    outsider = {**os.environ, **QUIET, "FLWR_HOME": str(config.parent)}
    # what the option allows, to whoever reaches the port
    assert _json(outsider, "ls", "plain", inside=federation)["runs"] == []
