"""No orphans of a Flower federation (`LocalFederation`): standard library only,
run as a script (`python -I flower_guard.py ...`: no package import, and not
its directory on `sys.path`, where `types.py` would shadow the standard one).

Every process of a federation carries the environment variable
`PFLAX_FEDERATION=TOKEN`, and so do the processes Flower starts from them (the
SuperExecs, ServerApps and ClientApps, whatever their process group).

- `python flower_guard.py exec PARENT COMMAND...` runs COMMAND so that the kernel
  kills it (SIGKILL) when the process PARENT dies, even by SIGKILL
  (`PR_SET_PDEATHSIG`, Linux; elsewhere it just runs COMMAND). A wrapper rather
  than a `preexec_fn`, which would fork the multithreaded (JAX) parent.
- `python flower_guard.py watch TOKEN [PATH...]` reads its stdin until a line
  "done" (a clean exit: nothing to do) or the end of the file, when the process
  holding the pipe died, however it died (SIGKILL included): then it kills
  (SIGKILL) every process of TOKEN (Linux; `/proc/PID/environ`) and removes
  each PATH (the federation's private folder with its certificate authority and
  node keys).
- `python flower_guard.py hold`, started by `unshare --user --map-root-user
  --net` (a new user and network namespace, in which only the processes pflax
  enters with `nsenter` live): brings the namespace's loopback interface up,
  prints "ready", then answers each line PORT of its stdin with "1" if
  something listens on 127.0.0.1:PORT in the namespace, else "0", until its
  stdin ends (the process holding the pipe closed it or died).
"""

import contextlib
import ctypes
import fcntl
import os
import shutil
import signal
import socket
import struct
import sys
import time

VARIABLE = "PFLAX_FEDERATION"
_PR_SET_PDEATHSIG = 1
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_IFREQ = "16sH22x"  # struct ifreq: the name, then ifr_flags in a 24-byte union


def sweep(token: str) -> int:
  """Kills (SIGKILL) every process of this user whose environment has
  `PFLAX_FEDERATION=token`, until none is left (at most a few seconds); returns
  how many it killed."""
  mark = f"{VARIABLE}={token}".encode()
  killed = 0
  for _ in range(50):
    found = 0
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
      if not name.isdigit() or int(name) == os.getpid():
        continue
      try:
        with open(f"/proc/{name}/environ", "rb") as f:
          if mark not in f.read().split(b"\0"):
            continue
        os.kill(int(name), signal.SIGKILL)
        found += 1
      except OSError:
        continue
    killed += found
    if not found:
      break
    time.sleep(0.1)
  return killed


def _exec(parent: int, command: list[str]) -> None:
  if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:  # the parent died before prctl
      sys.exit(1)
  os.execvp(command[0], command)


def _watch(token: str, paths: list[str]) -> None:
  for line in sys.stdin:
    if line.strip() == "done":
      return
  sweep(token)
  for path in paths:
    shutil.rmtree(path, ignore_errors=True)


def _loopback_up() -> None:
  """Sets the `lo` interface of this network namespace up (a new namespace's is
  down)."""
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    request = struct.pack(_IFREQ, b"lo", 0)
    flags = struct.unpack(_IFREQ, fcntl.ioctl(s, _SIOCGIFFLAGS, request))[1]
    fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))


def listening(port: int) -> bool:
  """Whether something listens on 127.0.0.1:`port` of this process's network."""
  with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
    return True
  return False


def _hold() -> None:
  _loopback_up()
  print("ready", flush=True)
  for line in sys.stdin:
    print("1" if listening(int(line)) else "0", flush=True)


if __name__ == "__main__":
  if sys.argv[1] == "exec":
    _exec(int(sys.argv[2]), sys.argv[3:])
  elif sys.argv[1] == "hold":
    _hold()
  else:
    _watch(sys.argv[2], sys.argv[3:])
