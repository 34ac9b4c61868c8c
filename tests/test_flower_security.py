"""A Flower federation of pflax on this machine against outsiders, and its end
(slow): a process with a Flower home of its own that knows only the port and
verifies the certificate (without pflax's CA, or without TLS) can neither list,
submit nor stop runs, nor join as a SuperNode (one that skips verification can:
docs/flower-security.md); SIGTERM or SIGKILL
of `pflax-run --flower` leaves no process, no listening port and no key folder; `pflax-run
--flower` finds Flower beside its Python when that is not on PATH."""

import json
import os
import shutil
import signal
import socket
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
  with flower.LocalFederation(2) as f:
    yield f


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
  return {**os.environ, **QUIET, "FLWR_HOME": str(home)}


def _flwr(env, *args):
  return subprocess.run([os.path.join(BIN, "flwr"), *args], env=env, text=True,
                        capture_output=True, timeout=90, check=False)


def _json(env, *args):
  done = _flwr(env, *args, "--format", "json")
  assert done.returncode == 0, done.stdout + done.stderr
  return json.loads(done.stdout)


@pytest.mark.parametrize("connection", ["plain", "tls"])
def test_an_outsider_can_neither_list_nor_submit_nor_stop(federation, rogue,
                                                           connection):
  for command in (["ls"], ["run", federation.app_dir], ["stop", "1"]):
    done = _flwr(rogue, *command, connection)
    assert done.returncode != 0, (command, done.stdout)
    assert "unavailable" in done.stdout + done.stderr, (command, done.stdout)
  assert _json(federation.env, "ls")["runs"] == []  # nothing was submitted


def test_an_outsider_that_skips_verification_lists_runs(federation):  # pylint: disable=redefined-outer-name
  """What docs/flower-security.md says Flower 1.42 allows: a process that skips
  certificate verification is served by the Control API (`list-runs`), since
  TLS does not authenticate the client. When Flower starts refusing it, this
  fails: then docs/flower-security.md and docs/flower.md can say the Control API
  is closed."""
  from flwr.proto import control_pb2  # pylint: disable=import-outside-toplevel,no-name-in-module
  script = (
      "import http.client, ssl, sys\n"
      f"c = http.client.HTTPSConnection('127.0.0.1', {federation.port}, timeout=60, "
      "context=ssl._create_unverified_context())\n"
      "c.request('POST', '/v1/control/list-runs', body=bytes.fromhex(sys.argv[1]), "
      "headers={'Content-Type': 'application/protobuf'})\n"
      "r = c.getresponse()\nprint(r.status, len(r.read()))\n")
  done = subprocess.run([sys.executable, "-I", "-c", script,
                         control_pb2.ListRunsRequest().SerializeToString().hex()],
                        capture_output=True, text=True, timeout=90, check=False)
  assert done.returncode == 0, done.stderr
  assert done.stdout.split()[0] == "200", done.stdout


def test_an_outsider_cannot_join_as_a_supernode(federation, rogue, tmp_path):
  """Without a registered key, even with pflax's CA certificate in hand, or
  without TLS, a SuperNode claiming partition 0 is not admitted."""
  ca = shutil.copy(os.path.join(federation.home, "tls", "ca.pem"), tmp_path)
  key = flower_keys.write_node_key(str(tmp_path / "keys"), "rogue")
  before = {n["node-id"] for n in _json(federation.env, "supernode", "ls")["nodes"]}
  attempts = {"unregistered key": ["--root-certificates", ca,
                                   "--auth-supernode-private-key", key.private],
              "no key": ["--root-certificates", ca], "no TLS": ["--insecure"]}
  logs, nodes = {}, []
  for name, flags in attempts.items():
    logs[name] = tmp_path / f"{name}.log"
    with open(logs[name], "w", encoding="utf-8") as log:
      nodes.append(subprocess.Popen(
          [os.path.join(BIN, "flower-supernode"), *flags, "--superlink",
           f"127.0.0.1:{federation.port}", "--port", str(flower_deploy.free_port()),
           "--node-config", "partition-id=0 num-partitions=2"],
          env=rogue, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
  try:
    time.sleep(20)
    after = _json(federation.env, "supernode", "ls")["nodes"]
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


def _listening(port):
  try:
    with socket.create_connection(("127.0.0.1", port), 1.0):
      return True
  except OSError:
    return False


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
  """The federation's token, ports and Flower home once its ServerApp runs."""
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
      return token, ports, home
    time.sleep(0.5)
  raise AssertionError("no ServerApp started")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL],
                         ids=["SIGTERM", "SIGKILL"])
def test_killing_pflax_run_flower_leaves_no_process_and_no_port(sig, tmp_path):
  process = _pflax_run(tmp_path, rounds=100)
  try:
    token, ports, home = _wait_for_the_server_app(process)
    assert ports and all(map(_listening, ports))
    assert os.path.isdir(os.path.join(home, "keys"))
    os.kill(process.pid, sig)
    output = process.communicate(timeout=40)[0]
    deadline = time.monotonic() + 5.0
    while _alive(token) and time.monotonic() < deadline:
      time.sleep(0.2)
    assert not _alive(token), [_cmdline(p) for p in _alive(token)]
    assert not any(map(_listening, ports))
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
    assert _json(outsider, "ls", "plain")["runs"] == []  # what the option allows
