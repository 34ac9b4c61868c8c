"""The credentials of a secure Flower federation (`flower_keys`) and the sweep
of its processes (`flower_guard`), without starting Flower."""

import os
import stat
import subprocess
import sys
import time
import types

import pytest

pytest.importorskip("cryptography")

from cryptography import x509  # pylint: disable=wrong-import-position
from cryptography.hazmat.primitives import serialization  # pylint: disable=wrong-import-position
from cryptography.hazmat.primitives.asymmetric import ec  # pylint: disable=wrong-import-position

from pflax._src.flower import guard as flower_guard  # pylint: disable=wrong-import-position
from pflax._src.flower import keys as flower_keys  # pylint: disable=wrong-import-position


def _mode(path):
  return stat.S_IMODE(os.stat(path).st_mode)


def test_the_server_certificate_is_signed_by_the_ca_for_the_hosts(tmp_path):
  paths = flower_keys.write_certificates(str(tmp_path / "tls"),
                                         ["127.0.0.1", "localhost"])
  ca, server = (x509.load_pem_x509_certificate(open(p, "rb").read())
                for p in (paths.ca, paths.cert))
  server.verify_directly_issued_by(ca)
  assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
  names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
  assert [str(a) for a in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
  assert names.get_values_for_type(x509.DNSName) == ["localhost"]
  key = serialization.load_pem_private_key(open(paths.key, "rb").read(), None)
  assert key.public_key().public_numbers() == server.public_key().public_numbers()
  assert _mode(tmp_path / "tls") == 0o700
  assert all(_mode(p) == 0o600 for p in paths)


def test_a_node_key_is_an_openssh_ec_pair_on_a_nist_curve(tmp_path):
  pair = flower_keys.write_node_key(str(tmp_path / "keys"), "node-0")
  private = serialization.load_ssh_private_key(open(pair.private, "rb").read(), None)
  public = serialization.load_ssh_public_key(open(pair.public, "rb").read())
  assert isinstance(private, ec.EllipticCurvePrivateKey)
  assert isinstance(private.curve, ec.SECP384R1)
  assert public.public_numbers() == private.public_key().public_numbers()
  assert _mode(pair.private) == 0o600 and _mode(tmp_path / "keys") == 0o700


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_sweep_kills_exactly_the_marked_processes():
  token = os.urandom(8).hex()
  env = {**os.environ, flower_guard.VARIABLE: token}
  marked = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env=env)
  other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    for _ in range(100):  # until the marked one has its environment (exec)
      with open(f"/proc/{marked.pid}/environ", "rb") as f:
        if token.encode() in f.read():
          break
      time.sleep(0.05)
    assert flower_guard.sweep(token) == 1
    assert marked.wait(5) == -9 and other.poll() is None
  finally:
    for p in (marked, other):
      p.kill()
      p.wait()


def test_a_deployment_past_the_available_memory_fails_before_starting(monkeypatch):
  flower_deploy = pytest.importorskip("pflax._src.flower.deploy")
  needed = flower_deploy.deployment_memory(8)
  assert needed == (flower_deploy.DEPLOYMENT_FIXED
                    + 8 * flower_deploy.DEPLOYMENT_PER_CLIENT)
  flower_deploy.check_memory(8, needed)  # fits exactly
  flower_deploy.check_memory(8, None)  # no /proc/meminfo: no check
  with pytest.raises(RuntimeError) as error:
    flower_deploy.check_memory(8, needed - 1)
  message = str(error.value)
  assert "\n" not in message and "8 clients" in message
  assert f"{needed / 2**30:.1f} GiB" in message and "--flower simulation" in message
  monkeypatch.setattr(flower_deploy, "available_memory", lambda: 2**30)
  federation = flower_deploy.LocalFederation(4)
  with pytest.raises(RuntimeError, match="4 clients"):
    federation.__enter__()
  assert federation.superlink is None and not federation.supernodes
  assert not os.path.exists(federation.workdir)  # nothing started, nothing left


def test_pflax_run_refuses_a_deployment_past_memory_in_one_line(tmp_path, monkeypatch):
  pytest.importorskip("flwr")
  from pflax._src.cli import main as cli  # pylint: disable=import-outside-toplevel
  from pflax._src.flower import deploy as flower_deploy  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(flower_deploy, "available_memory", lambda: 2**30)
  with pytest.raises(SystemExit) as info:
    cli.main(["--flower", "--algorithms", "fedavg", "--clients", "4",
              "--out", str(tmp_path / "out"), "--no-progress"])
  message = str(info.value)
  assert message.startswith("pflax-run: a Flower deployment of 4 clients needs about")
  assert "\n" not in message and "--flower simulation" in message


def test_flower_insecure_without_flower_is_one_line(tmp_path):
  from pflax._src.cli import main as cli  # pylint: disable=import-outside-toplevel
  with pytest.raises(SystemExit, match="^pflax-run: --flower-insecure is for --flower"):
    cli.main(["--flower-insecure", "--out", str(tmp_path / "out"), "--no-progress"])


@pytest.mark.parametrize("kwargs, match", [
    (dict(node_env={4: {"A": "1"}}), r"node_env's keys must be nodes in \[0, 4\), got \[4\]"),
    (dict(node_env={0: {"A": "1"}}, simulation=True), "node_env is for a deployment's"),
])
def test_node_env_names_existing_supernodes_of_a_deployment(kwargs, match):
  from pflax._src.flower import deploy as flower_deploy  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match=match):
    flower_deploy.LocalFederation(4, **kwargs)


def test_the_watchdog_removes_the_key_folder_when_its_parent_is_killed(tmp_path):
  """A parent that dies by SIGKILL closes the watchdog's stdin: the watchdog then
  removes the federation's private folder (its CA and node keys)."""
  secret = flower_keys.write_node_key(str(tmp_path / "home" / "keys"), "node-0")
  parent = subprocess.Popen([sys.executable, "-c", (
      "import subprocess, sys, time\n"
      f"subprocess.Popen([sys.executable, '-I', {flower_guard.__file__!r}, 'watch', "
      f"'no-such-token', {str(tmp_path / 'home')!r}], stdin=subprocess.PIPE, "
      "start_new_session=True)\n"
      "print('started', flush=True)\ntime.sleep(120)\n")],
                            stdout=subprocess.PIPE, text=True)
  try:
    assert parent.stdout.readline() == "started\n"
    assert os.path.exists(secret.private)
    parent.kill()
    parent.wait(10)
    deadline = time.monotonic() + 30.0
    while os.path.exists(tmp_path / "home") and time.monotonic() < deadline:
      time.sleep(0.1)
    assert not os.path.exists(tmp_path / "home")
  finally:
    parent.kill()
    parent.wait()


def test_a_federation_finds_a_module_builder_after_the_installed_packages(tmp_path):
  """`pflax-run --flower --algorithms module:builder` gives its processes the
  current folder after the installed packages: a `sitecustomize.py` there never
  runs, the builder module still imports."""
  from pflax._src.cli import federation  # pylint: disable=import-outside-toplevel
  (tmp_path / "work").mkdir()
  planted = tmp_path / "planted"
  (tmp_path / "work" / "sitecustomize.py").write_text(
      f"open({str(planted)!r}, 'w').close()\n")
  (tmp_path / "work" / "mine.py").write_text("def fedx(*a, **k):\n  pass\n")
  cwd = os.getcwd()
  os.chdir(tmp_path / "work")
  try:
    env = federation.federation_env(types.SimpleNamespace(
        algorithms=("mine:fedx",), compilation_cache=False))
  finally:
    os.chdir(cwd)
  assert str(tmp_path / "work") not in os.environ.get("PYTHONPATH", "") + env.get(
      "PYTHONPATH", "")
  child_env = {**os.environ, **env}
  done = subprocess.run([sys.executable, "-c", (
      "import sys\nfrom pflax._src.flower import experiment\n"
      "experiment._append_builder_path()\nimport mine\n"
      "print(sys.path[-1], mine.__file__)\n")],
                        cwd=tmp_path, env=child_env, capture_output=True, text=True,
                        check=False)
  assert done.returncode == 0, done.stderr
  assert done.stdout.split() == [str(tmp_path / "work"),
                                 str(tmp_path / "work" / "mine.py")]
  assert not planted.exists()


_LISTENER = """\
import socket, sys, time
s = socket.socket()
s.bind(('127.0.0.1', 0))
s.listen()
print(s.getsockname()[1], flush=True)
time.sleep(60)
"""


def test_a_private_network_is_reachable_from_inside_only():
  """A port opened in a `PrivateNetwork` is seen by its holder and refused to
  this process (the host's network); closing the network ends its holder."""
  import socket  # pylint: disable=import-outside-toplevel
  from pflax._src.flower import deploy as flower_deploy  # pylint: disable=import-outside-toplevel
  network = flower_deploy.private_network(os.environ)
  if network is None:
    pytest.skip("no private network namespace on this machine")
  listener = subprocess.Popen([*network.enter, sys.executable, "-I", "-c", _LISTENER],
                              stdout=subprocess.PIPE, text=True)
  try:
    port = int(listener.stdout.readline())
    assert network.listening(port)
    with pytest.raises(ConnectionRefusedError):
      socket.create_connection(("127.0.0.1", port), 1.0)
    listener.kill()
    listener.wait()
    assert not network.listening(port)
  finally:
    listener.kill()
    network.close()
  assert network.holder.poll() is not None


def test_isolate_true_refuses_to_start_without_a_private_network(monkeypatch):
  from pflax._src.flower import deploy as flower_deploy  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(flower_deploy, "private_network", lambda env: None)
  federation = flower_deploy.LocalFederation(1, isolate=True)
  with pytest.raises(RuntimeError, match="^LocalFederation.isolate=True.: no private "
                                         "network namespace could be made here"):
    federation.__enter__()
  assert federation.superlink is None and not os.path.exists(federation.workdir)
  with pytest.warns(UserWarning, match="listens on the host's loopback"):
    flower_deploy.LocalFederation(1)._open_network()  # pylint: disable=protected-access


def test_symlinks_planted_for_the_flower_logs_are_replaced_never_followed(tmp_path):
  """A `flower-logs` folder link and a `register.log` link planted in `--out`
  (by someone who can write there) are replaced: the federation's logs go
  into `--out`, and the files the links pointed at stay as they were."""
  from pflax._src.flower import deploy as flower_deploy  # pylint: disable=import-outside-toplevel
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  (elsewhere / "superlink.log").write_text("theirs")
  victim = tmp_path / "victim.txt"
  victim.write_text("theirs")
  out = tmp_path / "out"
  out.mkdir()
  (out / "flower-logs").symlink_to(elsewhere)
  federation = flower_deploy.LocalFederation(1, workdir=str(tmp_path / "work"),
                                             log_dir=str(out / "flower-logs"),
                                             isolate=False)
  federation._write_files()  # pylint: disable=protected-access
  logs = out / "flower-logs"
  assert logs.is_dir() and not logs.is_symlink()
  (logs / "register.log").symlink_to(victim)
  try:
    for name in ("superlink", "register"):
      log = federation._new_log(name)  # pylint: disable=protected-access
      federation._start("", [sys.executable, "-c", "print('ours')"], log).wait()  # pylint: disable=protected-access
      assert (logs / f"{name}.log").read_text() == "ours\n"
      assert not (logs / f"{name}.log").is_symlink()
  finally:
    federation.close()
  assert (elsewhere / "superlink.log").read_text() == "theirs"
  assert victim.read_text() == "theirs"
