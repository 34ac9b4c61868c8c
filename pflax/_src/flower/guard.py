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
"""

import ctypes
import os
import shutil
import signal
import sys
import time

VARIABLE = "PFLAX_FEDERATION"
_PR_SET_PDEATHSIG = 1


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


if __name__ == "__main__":
  if sys.argv[1] == "exec":
    _exec(int(sys.argv[2]), sys.argv[3:])
  else:
    _watch(sys.argv[2], sys.argv[3:])
