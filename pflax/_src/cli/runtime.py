"""Where `pflax-run`'s programs run: JAX's persistent compilation cache, several
hosts (`jax.distributed`), the `--devices` mesh, and SIGTERM as Ctrl-C."""

import contextlib
import os
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Iterator

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

CACHE_MIN_COMPILE_SECONDS = 0.1
"""Programs that compile faster than this are not cached (JAX's threshold)."""


def compilation_cache_dir() -> str:
  """Where `pflax-run` keeps JAX's persistent compilation cache: `$PFLAX_CACHE_DIR`,
  else `$XDG_CACHE_HOME/pflax/jax` (`~/.cache/pflax/jax`)."""
  if os.environ.get("PFLAX_CACHE_DIR"):
    return os.environ["PFLAX_CACHE_DIR"]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                         ".cache")
  return os.path.join(base, "pflax", "jax")


def cache_compilations_in(folder: str) -> None:
  """JAX's compilation cache in `folder`, for programs that compile in at least
  `CACHE_MIN_COMPILE_SECONDS`."""
  jax.config.update("jax_compilation_cache_dir", folder)
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    CACHE_MIN_COMPILE_SECONDS)


def use_compilation_cache() -> None:
  """JAX's persistent compilation cache in `compilation_cache_dir()`, unless one is
  configured already: a rerun of the same configuration skips compilation."""
  if jax.config.jax_compilation_cache_dir:
    return
  cache_compilations_in(compilation_cache_dir())


RUN_CACHE_PREFIX = "pflax-run-jax-cache-"
"""A run's own cache folder is `<temp dir>/pflax-run-jax-cache-<pid>@<host>@<random>`."""


def _run_cache_prefix() -> str:
  """This process's `RUN_CACHE_PREFIX`, its pid and its host (a temporary folder
  may be shared by several machines or containers, whose pids say nothing here)."""
  return f"{RUN_CACHE_PREFIX}{os.getpid()}@{socket.gethostname()}@"


def _process_alive(pid: int) -> bool:
  """Whether a process `pid` exists (one of another user's counts as alive)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # it exists
    pass
  return True


def remove_stale_run_caches() -> None:
  """Removes the cache folders of runs whose process is gone (`run_compilation_cache`
  removes its own when the run ends, but a killed process cannot) on this host.
  POSIX only (elsewhere `os.kill(pid, 0)` is no probe): nothing is removed."""
  if os.name != "posix":
    return
  root = tempfile.gettempdir()
  for name in os.listdir(root):
    fields = name.removeprefix(RUN_CACHE_PREFIX).split("@")
    if (name.startswith(RUN_CACHE_PREFIX) and len(fields) == 3
        and fields[1] == socket.gethostname() and fields[0].isdigit()
        and not _process_alive(int(fields[0]))):
      shutil.rmtree(os.path.join(root, name), ignore_errors=True)


@contextlib.contextmanager
def run_compilation_cache() -> Iterator[None]:
  """JAX's compilation cache in a temporary folder for the duration of the
  block, removed after it, unless a cache is configured already
  (`--no-compilation-cache`).

  Nothing is read from a persistent cache or kept after the run, but programs
  that are identical byte for byte compile once: in the main job, the client
  training that FedAvg, FedSA and FedReMa share with Local, FedProx's server
  step and two evaluations (`docs/main-job.md`). The folders of earlier runs
  that were killed (SIGKILL, which leaves no chance to clean up) are removed
  first (`remove_stale_run_caches`).
  """
  if jax.config.jax_compilation_cache_dir:
    yield
    return
  remove_stale_run_caches()
  folder = tempfile.mkdtemp(prefix=_run_cache_prefix())
  threshold = jax.config.jax_persistent_cache_min_compile_time_secs
  jax_cache.reset_cache()  # a process that compiled before found no cache
  cache_compilations_in(folder)
  try:
    yield
  finally:
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", threshold)
    jax_cache.reset_cache()
    shutil.rmtree(folder, ignore_errors=True)


def compilation_cache_env() -> dict[str, str]:
  """The environment that gives another process the same compilation cache."""
  return {"JAX_COMPILATION_CACHE_DIR": compilation_cache_dir(),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": str(CACHE_MIN_COMPILE_SECONDS)}


def join_hosts(coordinator_address: str | None, num_processes: int | None,
               process_id: int | None) -> None:
  """Connects this process to the others of a multi-host run
  (`jax.distributed.initialize`); an argument left None is detected (Slurm, Open
  MPI, Cloud TPU)."""
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id)


def mesh(devices: int | None) -> jax.sharding.Mesh | None:
  """A one-axis `clients` mesh over the first `devices` devices (None: no mesh);
  `checks.check_device_count` has checked that there are as many."""
  if devices is None:
    return None
  return jax.make_mesh((devices,), ("clients",), devices=jax.devices()[:devices],
                       axis_types=(jax.sharding.AxisType.Auto,))


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
  """SIGTERM (`kill`, `timeout`, Slurm) raises KeyboardInterrupt, as SIGINT does,
  so that what was started is stopped (in the main thread only)."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  def interrupt(signum, frame):
    del signum, frame
    raise KeyboardInterrupt
  previous = signal.signal(signal.SIGTERM, interrupt)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)
