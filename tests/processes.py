"""Reading other processes from /proc (Linux), for the Flower tests' checks that
nothing a federation started is left behind."""

import os


def pids() -> list[int]:
  """The ids of every process visible in /proc."""
  return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def environment(pid: int | str) -> dict[str, str]:
  """Process `pid`'s environment variables ({} when it is gone or unreadable)."""
  try:
    with open(f"/proc/{pid}/environ", "rb") as f:
      pairs = f.read().decode(errors="replace").split("\0")
  except OSError:
    return {}
  return dict(p.split("=", 1) for p in pairs if "=" in p)
