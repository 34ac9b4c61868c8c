"""One-line errors for run-level flags that cannot run together, before any work
starts (the experiment's own settings are checked as the config is resolved)."""

import contextlib
import fcntl
import importlib.util
import os
from collections.abc import Iterator

import jax

from pflax._src.cli import config as config_lib
from pflax._src.cli import messages
from pflax._src.simulation import experiment
from pflax._src.simulation import records

LOCK_FILE = ".pflax-run.lock"
"""The file in `--out` whose lock a run holds (`out_lock`)."""
MAX_FLOWER_TIMEOUT = 86_400.0
"""The longest `--flower-timeout`: a day."""


def check_run_flags(invocation: config_lib.Invocation) -> None:
  """Errors for run-level flags out of range, and an `--out` that cannot be
  written (created if missing)."""
  if invocation.checkpoint_every < 0:
    raise messages.fail(f"--checkpoint-every must be >= 0, got "
                        f"{invocation.checkpoint_every}")
  if invocation.devices is not None and invocation.devices < 1:
    raise messages.fail(f"--devices must be >= 1, got {invocation.devices}")
  if invocation.flower_insecure and not invocation.flower:
    raise messages.fail("--flower-insecure is for --flower federations")
  out = invocation.out
  try:
    os.makedirs(out, exist_ok=True)
    records.write_file(os.path.join(out, ".pflax-write-test"), b"")
    os.remove(os.path.join(out, ".pflax-write-test"))
  except OSError as e:
    raise messages.fail(f"--out {out} cannot be written: {e.strerror}") from None


@contextlib.contextmanager
def out_lock(out: str) -> Iterator[None]:
  """Holds `--out`'s lock (`fcntl.flock` on `out/.pflax-run.lock`, opened without
  following a symlink) while the run writes there; a second `pflax-run` on the
  same `--out` is a one-line error. The lock ends with the process, however it
  ends."""
  path = os.path.join(out, LOCK_FILE)
  try:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
  except OSError as e:
    raise messages.fail(f"--out {out}: cannot open its lock {LOCK_FILE}: "
                        f"{e.strerror}") from None
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise messages.fail(f"--out {out} is in use by another pflax-run; wait for it "
                          "to end or choose another --out") from None
    yield
  finally:
    os.close(fd)


def check_sweep_flags(invocation: config_lib.Invocation) -> None:
  """Errors for what a simulation's sweep does not run: `--sweep` or `--devices`
  one after another, checkpoints or the threaded loop over devices."""
  one_sweep = invocation.sweep is not None or invocation.devices
  if one_sweep and invocation.sequential:
    raise messages.fail("--sweep and --devices run as one sweep; they cannot be "
                        "combined with --sequential.")
  if invocation.devices and (invocation.checkpoint_every or invocation.resume):
    raise messages.fail("checkpoints are not supported with --devices.")
  if invocation.devices and invocation.config.strategy == "loop":
    raise messages.fail("--devices runs each round as one program over the "
                        "devices; use --strategy auto, vmap or map.")


def check_device_count(invocation: config_lib.Invocation) -> None:
  """An error for `--devices` beyond the devices JAX sees (every host's, once
  `--distributed` has joined them)."""
  devices = invocation.devices
  if devices is not None and not 1 <= devices <= jax.device_count():
    raise messages.fail(f"--devices must be in [1, {jax.device_count()}] (the "
                        f"devices JAX sees), got {devices}; on CPU set XLA_FLAGS="
                        "--xla_force_host_platform_device_count=N.")


def check_flower_flags(invocation: config_lib.Invocation) -> None:
  """Errors for what a Flower federation does not run, for a Flower (or its
  simulation engine) not installed, and for too little memory for its nodes."""
  for flag, used in (("--devices", invocation.devices), ("--sweep", invocation.sweep),
                     ("--distributed", invocation.distributed),
                     ("--checkpoint-every", invocation.checkpoint_every),
                     ("--resume", invocation.resume),
                     ("--precision bf16", invocation.config.precision != "float32")):
    if used:
      raise messages.fail(f"{flag} is for simulations; --flower runs each seed as a "
                          "federation of its own")
  if not 0 < invocation.flower_timeout <= MAX_FLOWER_TIMEOUT:
    raise messages.fail(f"--flower-timeout must be in (0, {MAX_FLOWER_TIMEOUT}] "
                        f"seconds, got {invocation.flower_timeout}")
  if importlib.util.find_spec("flwr") is None:
    raise messages.fail("--flower needs Flower: pip install 'pflax[flower]'")
  from pflax._src.flower import experiment as flower_experiment  # pylint: disable=import-outside-toplevel
  if invocation.flower == "simulation" and importlib.util.find_spec("ray") is None:
    raise messages.fail("--flower simulation needs Flower's simulation engine: pip "
                        "install 'flwr[simulation]'")
  config = invocation.config
  for name in invocation.algorithms:
    try:
      flower_experiment.Experiment(name, config, invocation.seeds[0]).check()
    except ValueError as e:
      raise messages.fail(f"--flower: {messages.flag_message(e)}") from None
  if invocation.flower == "deployment":
    from pflax._src.flower import deploy as flower_deploy  # pylint: disable=import-outside-toplevel
    try:
      flower_deploy.check_memory(config.clients, flower_deploy.available_memory())
    except RuntimeError as e:
      raise messages.fail(str(e)) from None


def check_tune_flags(invocation: config_lib.Invocation) -> None:
  """Errors for what `--tune` does not run, and for keys an algorithm cannot
  differentiate."""
  for flag, used in (("--sweep", invocation.sweep), ("--flower", invocation.flower),
                     ("--distributed", invocation.distributed),
                     ("--devices", invocation.devices),
                     ("--checkpoint-every", invocation.checkpoint_every),
                     ("--resume", invocation.resume),
                     ("--heterogeneous", invocation.config.heterogeneous)):
    if used:
      raise messages.fail(f"--tune cannot be combined with {flag}")
  if invocation.config.strategy == "loop":
    raise messages.fail("--tune needs --strategy vmap, map or auto: the threaded loop "
                        "runs clients outside JAX and cannot be differentiated")
  if len(invocation.seeds) > 1:
    seeds = " ".join(map(str, invocation.seeds))
    raise messages.fail(f"--tune tunes with one seed, got --seeds {seeds}")
  if not 0 <= invocation.tune_steps <= experiment.MAX_COUNT:
    raise messages.fail(f"--tune-steps must be in [0, {experiment.MAX_COUNT}], got "
                        f"{invocation.tune_steps}")
  if not 0 < invocation.tune_lr <= experiment.MAX_LR:
    raise messages.fail(f"--tune-lr must be in (0, {experiment.MAX_LR:g}], got "
                        f"{invocation.tune_lr}")
  if not 0 < invocation.tune_validation < 1:
    raise messages.fail(f"--tune-validation must be in (0, 1), got "
                        f"{invocation.tune_validation}")
  from pflax._src.simulation import tune  # pylint: disable=import-outside-toplevel
  for name in invocation.algorithms:
    try:
      tune.check_keys(name, invocation.tune)
    except ValueError as e:
      raise messages.fail(f"--tune: {e}") from None


def check_flags(invocation: config_lib.Invocation) -> None:
  """Every check of the run-level flags, in the order the run needs them."""
  if invocation.tune:
    check_tune_flags(invocation)
  check_run_flags(invocation)
  if invocation.flower:
    check_flower_flags(invocation)
  elif not invocation.tune:
    check_sweep_flags(invocation)
