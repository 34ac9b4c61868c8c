"""`pflax-run`: run algorithms on a federated dataset, write results and plots."""

import argparse
import contextlib
import dataclasses
import importlib.util
import inspect
import json
import os
import signal
import sys
import threading
import typing
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from pflax._src.data import datasets
from pflax._src.methods import registry
from pflax._src.simulation import presets
from pflax._src.simulation import records
from pflax._src.simulation import simulate


FIELD_HELP = {
    "dataset": "'digits' (offline) or a prepared TFDS name: mnist, fashion_mnist, "
               "cifar10, cifar100, emnist/letters",
    "data_dir": "TFDS data directory",
    "iid_fraction": "FedReMa's s for --partition groups",
    "samples_per_client": "each client's samples (unset: all it is dealt), test "
                          "samples included with --test-split clients (FedReMa: "
                          "600): --partition groups draws exactly this many, the "
                          "others keep a random subset of at most this many",
    "test_fraction": "each client's share of test samples, per class (FedReMa's 4:1: "
                     "0.2)",
    "test_split": "clients: pool the dataset's train and test splits, partition, and "
                  "split each client's data by --test-fraction (the papers); "
                  "dataset: partition the train split and test each client on the "
                  "dataset's own test split, dealt with its class mix",
    "faulty_clients": "each round this fraction of the participants, drawn from the "
                      "run's key, is faulty (see --fault-kind)",
    "fault_kind": "what faulty clients do: nan uploads NaN, scaled multiplies its "
                  "update by --fault-scale, inflated_counts declares its class "
                  "counts times --fault-scale (--faulty-clients of all clients)",
    "fault_scale": "the factor of scaled (default 1e30) and inflated_counts "
                   "(default 10)",
    "outlier_factor": "drop a participant whose update norm exceeds this many times "
                      "the round's median (0: never)",
    "eval_every": "evaluate every N rounds (and after the last)",
    "model": "auto: the CNN for images of 16+ pixels, the MLP for digits",
    "heterogeneous": "clients use four architectures sharing the output layer "
                     "(algorithms that share a head: "
                     f"{', '.join(simulate.HEAD_SHARING)})",
    "family": "the architectures of --heterogeneous clients: cnn (three CNNs and an "
              "MLP) or mlp (four MLPs, CPU-sized)",
    "strategy": "how clients are mapped in local training",
    "lr": "the clients' learning rate (FedClassAvg: its own, see --set)",
    "grad_clip": "clip each local model's gradient to this global norm (FedDWA's w "
                 "and v each on its own)",
}
FIELD_CHOICES = {"partition": simulate.PARTITIONS, "test_split": simulate.TEST_SPLITS,
                 "fault_kind": ("nan", "scaled", "inflated_counts"),
                 "model": ("auto", "cnn", "mlp"),
                 "family": ("cnn", "mlp"),
                 "strategy": ("auto", "vmap", "loop", "map"),
                 "optimizer": ("sgd", "adam")}
CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(simulate.ExperimentConfig)
                      if f.name not in ("optimizers", "hyperparameters"))
"""`ExperimentConfig` fields with a flag of their own (`--name-with-dashes`)."""


def _flag(field: str) -> str:
  return "--" + field.replace("_", "-")


def _field_type(field: str) -> Any:
  """The flag's type: the field's annotation, without its `| None`."""
  annotation = {f.name: f.type for f in dataclasses.fields(simulate.ExperimentConfig)
                }[field]
  options = [t for t in typing.get_args(annotation) if t is not type(None)]
  return options[0] if options else annotation


def _parser() -> argparse.ArgumentParser:
  defaults = simulate.ExperimentConfig()
  names = tuple(registry.BUILDERS)
  p = argparse.ArgumentParser(
      prog="pflax-run", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
      description="Personalized federated learning experiments with pflax. With no "
                  "arguments: all eight algorithms on the offline digits dataset.")
  p.add_argument("--algorithms", nargs="+", default=list(registry.DEFAULT_ALGORITHMS),
                 metavar="NAME",
                 help=f"any of {' '.join(names)}, or your own builder as "
                      "module:function (importable from the current directory)")
  for field in CONFIG_FIELDS:
    default = getattr(defaults, field)
    if isinstance(default, bool):
      p.add_argument(_flag(field), action="store_true", help=FIELD_HELP.get(field))
    else:
      p.add_argument(_flag(field), type=_field_type(field), default=default,
                     choices=FIELD_CHOICES.get(field),
                     help=FIELD_HELP.get(field, field.replace("_", " ")))
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="a keyword of the chosen algorithms' builders (e.g. wdr_coef=10, "
                      "fedclassavg.rho=0.5) or of an algorithm's optimizer "
                      "(fedclassavg.lr=1e-4); NAME.KEY sets it for one algorithm only; "
                      "repeatable")
  p.add_argument("--download", action="store_true",
                 help="let TFDS download and prepare --dataset into --data-dir if it "
                      "is not prepared (off: fail fast, offline)")
  p.add_argument("--list-presets", action="store_true",
                 help="list the papers' headline settings and exit")
  p.add_argument("--preset", default=None, metavar="NAME",
                 help="every value of a paper's headline setting (see "
                      "--list-presets); flags given as well override it")
  p.add_argument("--config", default=None, metavar="FILE",
                 help="re-run the experiment of a results.json (or of its 'config'); "
                      "flags given as well override it")
  p.add_argument("--print-config", action="store_true",
                 help="print the resolved configuration as JSON (results.json's "
                      "'config') and exit")
  p.add_argument("--seeds", type=int, nargs="+", default=[0],
                 help="several seeds run as one sweep (see --sequential)")
  p.add_argument("--sweep", default=None, metavar="HYPERPARAMETER",
                 help="also sweep this numeric hyperparameter over --values, "
                      "together with the seeds: lr or any float keyword of the "
                      "algorithm's builder (e.g. wdr_coef for cwfedavg)")
  p.add_argument("--values", type=float, nargs="+", default=[],
                 help="the values of --sweep")
  p.add_argument("--tune", nargs="+", default=None, metavar="KEY",
                 help="instead of the runs, tune these float hyperparameters of "
                      "each algorithm by gradient descent on a held-out validation "
                      "loss (pflax.tune; e.g. lr wdr_coef for cwfedavg) and write "
                      "tune_<algorithm>.json and .png")
  p.add_argument("--tune-steps", type=int, default=10,
                 help="--tune's gradient steps, each through --rounds rounds")
  p.add_argument("--tune-lr", type=float, default=0.1,
                 help="--tune's Adam learning rate in the unconstrained coordinates "
                      "(log of a positive value, logit of a fraction)")
  p.add_argument("--tune-validation", type=float, default=0.2,
                 help="--tune's share of each client's training split held out for "
                      "validation (per class)")
  p.add_argument("--devices", type=int, default=None,
                 help="split the clients over this many devices (a 'clients' mesh "
                      "axis; on CPU, force host devices with XLA_FLAGS="
                      "--xla_force_host_platform_device_count=N)")
  p.add_argument("--distributed", action="store_true",
                 help="call jax.distributed.initialize() first (several hosts; "
                      "arguments detected on Slurm, Open MPI and Cloud TPU, else "
                      "give the three below); --devices then counts all hosts' "
                      "devices and only process 0 writes results")
  p.add_argument("--coordinator-address", default=None, help="host:port of process 0")
  p.add_argument("--num-processes", type=int, default=None, help="processes in all")
  p.add_argument("--process-id", type=int, default=None, help="this process (0: writes)")
  p.add_argument("--flower", nargs="?", const="deployment", default=None,
                 choices=("deployment", "simulation"),
                 help="run each algorithm and seed as a Flower federation (pip "
                      "install 'pflax[flower]'): 'deployment' (the default when "
                      "given alone) starts a SuperLink and one SuperNode per client "
                      "as processes on 127.0.0.1; 'simulation' a SuperLink with "
                      "Flower's simulation engine (Ray)")
  p.add_argument("--flower-timeout", type=float, default=600.0,
                 help="seconds the Flower server waits for a round's replies; a "
                      "client that has not replied by then is dropped")
  p.add_argument("--flower-insecure", action="store_true",
                 help="run the Flower federation without TLS and SuperNode "
                      "authentication (a warning): any process on this machine "
                      "that knows the port could then use it. By default each "
                      "federation has its own certificates and node keys")
  p.add_argument("--sequential", action="store_true",
                 help="run seeds one after another instead of as one sweep")
  p.add_argument("--out", default="runs/latest", help="output directory")
  p.add_argument("--checkpoint-every", type=int, default=0,
                 help="save a checkpoint every N rounds (0: never)")
  p.add_argument("--resume", action="store_true",
                 help="continue from the checkpoints in --out")
  p.add_argument("--no-compilation-cache", action="store_true",
                 help="do not use JAX's persistent compilation cache (by default "
                      f"in {compilation_cache_dir()})")
  p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
  return p


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


def _given(argv: Sequence[str] | None) -> set[str]:
  """The destinations of the flags given on the command line."""
  quiet = _parser()
  for action in quiet._actions:  # pylint: disable=protected-access
    action.default = argparse.SUPPRESS
  return set(vars(quiet.parse_args(argv)))


def _fail(message: str) -> SystemExit:
  return SystemExit(f"pflax-run: {message}")


def _flag_message(error: Exception) -> str:
  """A configuration error (or warning) with its leading field named as the
  command-line flag: `clients must ...`, `clients: ...` -> `--clients ...`."""
  text = str(error)
  for field in CONFIG_FIELDS:
    if text.startswith((field + " ", field + ":")):
      return _flag(field) + text[len(field):]
  return text


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
"""Warnings issued from files under this directory are pflax's own."""


def _one_line_warnings(show: Callable[..., None]) -> Callable[..., None]:
  """A `warnings.showwarning` that prints pflax's warnings as one line
  `pflax-run: warning: ...` on stderr (fields named as flags), others as `show`."""
  def showwarning(message, category, filename, lineno, file=None, line=None):
    if os.path.abspath(filename).startswith(_PACKAGE_DIR):
      print(f"pflax-run: warning: {_flag_message(message)}", file=sys.stderr)
    else:
      show(message, category, filename, lineno, file, line)
  return showwarning


def _typed(key: str, text: str, default: Any) -> Any:
  """`text` as the type of a keyword's default (bool, int, float, str)."""
  try:
    if isinstance(default, bool):
      if text.lower() not in ("true", "false", "1", "0"):
        raise ValueError(text)
      return text.lower() in ("true", "1")
    if isinstance(default, (int, float, str)):
      return type(default)(text)
    return float(text)
  except ValueError:
    raise _fail(f"--set {key}: {text!r} is not a {type(default).__name__}") from None


def _settable(name: str) -> dict[str, Any]:
  """`{key: default}` of what `--set` may set for one algorithm: its builder's
  keywords with plain defaults or `float | None = None` (`max_share`), and its
  optimizer's fields."""
  params = inspect.signature(simulate.resolve_builder(name)).parameters.values()
  keys = {p.name: p.default for p in params if p.kind == p.KEYWORD_ONLY
          and (isinstance(p.default, (bool, int, float, str))
               or (p.default is None and "float" in str(p.annotation)))}
  defaults = simulate.ExperimentConfig()
  keys.update({f: getattr(defaults, f) for f in simulate.OPTIMIZER_FIELDS})
  return keys


def _apply_sets(config: simulate.ExperimentConfig, algorithms: Sequence[str],
                sets: Sequence[str]) -> simulate.ExperimentConfig:
  """`config` with the `--set KEY=VALUE` assignments (see the flag's help)."""
  hyperparameters = {k: dict(v) for k, v in config.hyperparameters.items()}
  optimizers = {k: dict(v) for k, v in config.optimizers.items()}
  for item in sets:
    key, sep, text = item.partition("=")
    if not sep:
      raise _fail(f"--set takes KEY=VALUE, got {item!r}")
    name, _, field = key.rpartition(".")
    targets = [name] if name else list(algorithms)
    if name and name not in algorithms:
      raise _fail(f"--set {key}: {name!r} is not one of --algorithms "
                  f"{' '.join(algorithms)}")
    hits = [t for t in targets if field in _settable(t)]
    if not hits:
      valid = sorted({f"{t}.{k}" for t in targets for k in _settable(t)})
      raise _fail(f"--set {key}: unknown key; valid keys: {', '.join(valid)}")
    for target in hits:
      default = _settable(target)[field]
      table = optimizers if field in simulate.OPTIMIZER_FIELDS else hyperparameters
      table.setdefault(target, {})[field] = _typed(key, text, default)
  return dataclasses.replace(config, hyperparameters=hyperparameters,
                             optimizers=optimizers)


def _loaded(path: str) -> dict[str, Any]:
  """The `config` of a results.json (or a bare config), as written by pflax-run."""
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, ValueError) as e:
    raise _fail(f"--config {path}: {e}") from None
  config = data.get("config", data) if isinstance(data, dict) else None
  if not isinstance(config, dict):
    raise _fail(f"--config {path}: not a results.json (a JSON object, or one with "
                "a 'config' object)")
  return config


def _importing(name: Any) -> bool:
  """Whether running the algorithm `name` imports a module (`module:builder`)."""
  return isinstance(name, str) and ":" in name and name not in registry.BUILDERS


def _not_importing(saved: dict[str, Any], path: str, command_line: Sequence[str]
                   ) -> dict[str, Any]:
  """`saved` (a `--config` file's config), which imports no module: a
  `module:builder` it runs must be on the command line as well (`--algorithms`),
  else it is an error; its `hyperparameters` and `optimizers` for a
  `module:builder` not on the command line configure no algorithm of this run and
  are left out. A shared results.json cannot run code of its choosing."""
  algorithms = saved.get("algorithms", [])
  if not isinstance(algorithms, list) or not all(isinstance(a, str)
                                                 for a in algorithms):
    raise _fail(f"--config {path}: algorithms must be a list of names, got "
                f"{algorithms!r}")
  imported = next(filter(_importing, algorithms), None)
  if imported is not None and not command_line:
    raise _fail(f"--config names the algorithm {imported!r} (a module to import); "
                "give it with --algorithms to run it")
  saved = dict(saved)
  for table in ("hyperparameters", "optimizers"):
    if isinstance(saved.get(table), dict):
      saved[table] = {name: entry for name, entry in saved[table].items()
                      if not _importing(name) or name in command_line}
  return saved


def config_from_args(args: argparse.Namespace, given: set[str]
                     ) -> simulate.ExperimentConfig:
  """The experiment configuration named by the command line: `--config`'s, with the
  flags given (and `--set`) on top."""
  base = {}
  if args.preset:
    try:
      preset = presets.get(args.preset)
    except ValueError as e:
      raise _fail(f"--preset: {e}") from None
    base = dict(preset.config)
    if "algorithms" not in given:
      args.algorithms = list(preset.algorithms)
    if "seeds" not in given:
      args.seeds = list(preset.seeds)
  if args.config:
    saved = _not_importing(_loaded(args.config), args.config,
                           args.algorithms if "algorithms" in given else ())
    run_level = ("algorithms", "seeds", "devices", "sweep", "preset", "flower")
    unknown = set(saved) - set(CONFIG_FIELDS) - {"optimizers", "hyperparameters",
                                                  *run_level}
    if unknown:
      raise _fail(f"--config {args.config}: unknown keys {', '.join(sorted(unknown))}")
    base.update({k: v for k, v in saved.items() if k not in run_level})
    for key, dest in (("algorithms", "algorithms"), ("seeds", "seeds"),
                      ("devices", "devices")):
      if key in saved and dest not in given:
        setattr(args, dest, saved[key])
    if "sweep" in saved and "sweep" not in given and saved["sweep"]:
      (args.sweep, args.values), = saved["sweep"].items()
    if saved.get("flower") and "flower" not in given:
      args.flower = saved["flower"]["engine"]
  flags = {f: getattr(args, f) for f in CONFIG_FIELDS if f in given or f not in base}
  try:
    config = simulate.ExperimentConfig(**{**base, **flags})
    config = _apply_sets(config, args.algorithms, args.set)
    simulate.check_config(config)
    simulate.check_algorithm_keys(config, args.algorithms)
    for name in args.algorithms:
      simulate.check_algorithm(name, config)
      if (config.heterogeneous and name in registry.BUILDERS
          and name not in simulate.HEAD_SHARING):
        raise ValueError(f"--heterogeneous needs algorithms that share a head "
                         f"({', '.join(simulate.HEAD_SHARING)}), got {name!r}")
  except (ValueError, TypeError) as e:
    raise _fail(_flag_message(e)) from None
  return config


def _swept(args: argparse.Namespace) -> bool:
  """Whether the seeds (and --sweep values) run as one sweep."""
  several = len(args.seeds) > 1 or args.sweep is not None or args.devices
  if (args.sweep is not None or args.devices) and args.sequential:
    raise SystemExit("pflax-run: --sweep and --devices run as one sweep; they cannot "
                     "be combined with --sequential.")
  if args.devices and (args.checkpoint_every or args.resume):
    raise SystemExit("pflax-run: checkpoints are not supported with --devices.")
  if args.devices and args.strategy == "loop":
    raise SystemExit("pflax-run: --devices runs each round as one program over the "
                     "devices; use --strategy auto, vmap or map.")
  return bool(several) and not args.sequential


def _mesh(devices: int | None) -> jax.sharding.Mesh | None:
  """A one-axis `clients` mesh over the first `devices` devices (None: no mesh)."""
  if devices is None:
    return None
  if not 1 <= devices <= jax.device_count():
    raise SystemExit(f"pflax-run: --devices must be in [1, {jax.device_count()}] (the "
                     f"devices JAX sees), got {devices}; on CPU set XLA_FLAGS="
                     "--xla_force_host_platform_device_count=N.")
  return jax.make_mesh((devices,), ("clients",), devices=jax.devices()[:devices],
                       axis_types=(jax.sharding.AxisType.Auto,))


def _progress(total: int, label: str, enabled: bool) -> Any:
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  return tqdm(total=total, desc=label, disable=not enabled, leave=False,
              file=sys.stderr, dynamic_ncols=True)


def _config_dict(config: simulate.ExperimentConfig, args: argparse.Namespace
                 ) -> dict[str, Any]:
  """`results.json`'s `config`: every value the run uses, the builders' and the
  optimizers' included, and the run-level choices (algorithms, seeds, sweep)."""
  out = dataclasses.asdict(config)
  out["hyperparameters"] = {}
  out["optimizers"] = {}
  for name in args.algorithms:
    settable = _settable(name)
    optimizer = {f: settable.pop(f) for f in simulate.OPTIMIZER_FIELDS}
    out["hyperparameters"][name] = {**settable, **config.hyperparameters.get(name, {})}
    out["optimizers"][name] = {**{f: getattr(config, f) for f in optimizer},
                               **config.optimizers.get(name, {})}
  out["algorithms"] = list(args.algorithms)
  out["preset"] = args.preset
  out["seeds"] = list(args.seeds)
  out["devices"] = args.devices
  if args.sweep:
    out["sweep"] = {args.sweep: list(args.values)}
  return out


def _check_run_flags(args: argparse.Namespace) -> None:
  """One-line errors for run-level flags, before any work starts."""
  if args.checkpoint_every < 0:
    raise _fail(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
  if args.devices is not None and args.devices < 1:
    raise _fail(f"--devices must be >= 1, got {args.devices}")
  if args.flower_insecure and not args.flower:
    raise _fail("--flower-insecure is for --flower federations")
  try:
    os.makedirs(args.out, exist_ok=True)
    probe = os.path.join(args.out, ".pflax-write-test")
    with open(probe, "w", encoding="utf-8"):
      pass
    os.remove(probe)
  except OSError as e:
    raise _fail(f"--out {args.out} cannot be written: {e.strerror}") from None


def _check_flower_flags(args: argparse.Namespace, config: simulate.ExperimentConfig
                        ) -> None:
  """One-line errors for what a Flower federation does not run."""
  for flag, used in (("--devices", args.devices), ("--sweep", args.sweep),
                     ("--distributed", args.distributed),
                     ("--checkpoint-every", args.checkpoint_every),
                     ("--resume", args.resume)):
    if used:
      raise _fail(f"{flag} is for simulations; --flower runs each seed as a "
                  "federation of its own")
  if args.flower_timeout <= 0:
    raise _fail(f"--flower-timeout must be > 0, got {args.flower_timeout}")
  try:
    from pflax import flower  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise _fail("--flower needs Flower: pip install 'pflax[flower]'") from None
  if args.flower == "simulation" and importlib.util.find_spec("ray") is None:
    raise _fail("--flower simulation needs Flower's simulation engine: pip install "
                "'flwr[simulation]'")
  for name in args.algorithms:
    try:
      flower.Experiment(name, config, args.seeds[0]).check()
    except ValueError as e:
      raise _fail(f"--flower: {_flag_message(e)}") from None
  if args.flower == "deployment":
    from pflax._src.flower import deploy as flower_deploy  # pylint: disable=import-outside-toplevel
    try:
      flower_deploy.check_memory(config.clients, flower_deploy.available_memory())
    except RuntimeError as e:
      raise _fail(str(e)) from None


def _check_tune_flags(args: argparse.Namespace, config: simulate.ExperimentConfig
                      ) -> None:
  """One-line errors for what `--tune` does not run, and for keys an algorithm
  cannot differentiate, before any work starts."""
  for flag, used in (("--sweep", args.sweep), ("--flower", args.flower),
                     ("--distributed", args.distributed), ("--devices", args.devices),
                     ("--checkpoint-every", args.checkpoint_every),
                     ("--resume", args.resume),
                     ("--heterogeneous", config.heterogeneous)):
    if used:
      raise _fail(f"--tune cannot be combined with {flag}")
  if config.strategy == "loop":
    raise _fail("--tune needs --strategy vmap, map or auto: the threaded loop runs "
                "clients outside JAX and cannot be differentiated")
  if len(args.seeds) > 1:
    seeds = " ".join(map(str, args.seeds))
    raise _fail(f"--tune tunes with one seed, got --seeds {seeds}")
  if args.tune_steps < 0:
    raise _fail(f"--tune-steps must be >= 0, got {args.tune_steps}")
  if not args.tune_lr > 0:
    raise _fail(f"--tune-lr must be > 0, got {args.tune_lr}")
  if not 0 < args.tune_validation < 1:
    raise _fail(f"--tune-validation must be in (0, 1), got {args.tune_validation}")
  from pflax._src.simulation import tune  # pylint: disable=import-outside-toplevel
  for name in args.algorithms:
    try:
      tune.check_keys(name, args.tune)
    except ValueError as e:
      raise _fail(f"--tune: {e}") from None


def _federation_env(args: argparse.Namespace) -> dict[str, str]:
  """The environment of the federation's processes: JAX's compilation cache, and the
  current directory appended to the Python path only for a `module:builder` of
  `--algorithms` (never first: a `tqdm.py` there must not shadow a package)."""
  env = {}
  if any(map(_importing, args.algorithms)):
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.environ.get("PYTHONPATH"), os.getcwd()) if p)
  if not args.no_compilation_cache:
    env.update(
        JAX_COMPILATION_CACHE_DIR=compilation_cache_dir(),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=str(CACHE_MIN_COMPILE_SECONDS))
  return env


def _federate(config: simulate.ExperimentConfig, args: argparse.Namespace
              ) -> tuple[list[records.RunRecord], dict[str, Any]]:
  """Every algorithm and seed as a Flower federation (`--flower`): the runs, and
  results.json's `config["flower"]` (engine, Flower's version, bytes per round).

  The federation's logs are written to `--out/flower-logs` and each run's
  results to `--out/flower-runs/run-N` as it goes, so that a failed or stopped
  run keeps them; SIGTERM stops the federation as SIGINT does.
  """
  import flwr  # pylint: disable=import-outside-toplevel
  from pflax import flower  # pylint: disable=import-outside-toplevel
  from pflax._src.flower import deploy as flower_deploy  # pylint: disable=import-outside-toplevel
  runs, traffic = [], {}
  logs = os.path.abspath(os.path.join(args.out, "flower-logs"))
  kept = (f"the Flower logs are in {logs}, the results so far in "
          f"{os.path.abspath(os.path.join(args.out, 'flower-runs'))}")
  try:
    with _sigterm_as_interrupt(), flower_deploy.LocalFederation(
        config.clients, env=_federation_env(args),
        simulation=args.flower == "simulation", insecure=args.flower_insecure,
        log_dir=logs) as federation:
      for name in args.algorithms:
        for seed in args.seeds:
          bar = _progress(config.rounds, f"{name} seed {seed} (flower)",
                          not args.no_progress)
          results = federation.run(
              flower.Experiment(name, config, seed),
              os.path.join(args.out, "flower-runs", f"run-{len(runs)}"),
              timeout=args.flower_timeout, on_round=lambda n: bar.update(n - bar.n))
          bar.close()
          run, = results.runs
          _report(run)
          runs.append(run)
          traffic[f"{name} seed {seed}"] = results.config["flower"]["bytes_per_round"]
  except RuntimeError as e:
    raise _fail(f"{e}\n{kept}") from None
  except KeyboardInterrupt:
    print(f"pflax-run: stopped; {kept}", file=sys.stderr)
    raise
  return runs, {"engine": args.flower, "version": flwr.__version__,
                "bytes_per_round": traffic}


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
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


def _report(run: records.RunRecord) -> None:
  summary = run.summary()
  print(f"{run.label:12s} seed {run.seed}: personalized best {summary.best:.4f} "
        f"final {summary.final:.4f} ({run.seconds:.1f} s)", flush=True)


def _sweep(name: str, config: simulate.ExperimentConfig, args: argparse.Namespace,
           seeds: list[int], setups: dict[int, simulate.Setup]
           ) -> list[records.RunRecord]:
  """The seeds (and --sweep values) of one algorithm as one sweep, with a progress
  bar and checkpoints as asked."""
  runs = len(seeds) * max(len(args.values), 1)
  label = f"{name} seed {seeds[0]}" if runs == 1 else f"{name} x{runs}"
  bar = _progress(config.rounds, label, not args.no_progress)

  def on_round(t, rounds):
    del t
    accs = [r.accuracy() for r in rounds if r.accuracy() is not None]
    if accs:
      bar.set_postfix(acc=f"{np.mean(accs):.3f}",
                      loss=f"{np.mean([r.train_loss for r in rounds]):.3f}")
    bar.update(1)

  checkpoints = args.out if args.checkpoint_every or args.resume else None
  try:
    out = simulate.sweep(name, config, seeds, hyperparameter=args.sweep,
                         values=args.values, setups=setups, on_round=on_round,
                         mesh=_mesh(args.devices), checkpoint_dir=checkpoints,
                         checkpoint_every=args.checkpoint_every, resume=args.resume)
  except ValueError as e:
    raise SystemExit(f"pflax-run: {e}") from None
  bar.close()
  for run in out:
    _report(run)
  return out


def _tune(config: simulate.ExperimentConfig, args: argparse.Namespace,
          setup: simulate.Setup) -> list[Any]:
  """`--tune`: each algorithm's keys tuned by gradient (`pflax.tune.tune`) from
  their configured values, its path written as `tune_<algorithm>.json` and
  `.png` in `--out`; the records."""
  import optax  # pylint: disable=import-outside-toplevel
  from pflax._src.simulation import tune  # pylint: disable=import-outside-toplevel
  recorded = []
  for name in args.algorithms:
    try:
      task = tune.make_task(name, config, args.tune, setup=setup,
                            validation_fraction=args.tune_validation)
    except ValueError as e:
      raise _fail(f"--tune: {_flag_message(e)}") from None
    bar = _progress(args.tune_steps + 1, f"{name} tune", not args.no_progress)

    def on_step(point, bar=bar):
      bar.set_postfix(val=f"{point.validation_loss:.3f}")
      bar.update(1)

    record = tune.tune(task, steps=args.tune_steps, seed=args.seeds[0],
                       optimizer=optax.adam(args.tune_lr),
                       optimizer_label=f"adam({args.tune_lr:g})", on_step=on_step)
    bar.close()
    stem = os.path.join(args.out, "tune_" + "".join(
        c if c.isalnum() or c in "-_" else "_" for c in name))
    record.save(stem + ".json")
    record.plot(stem + ".png")
    recorded.append(record)
  print(_tune_table(recorded))
  print(f"wrote tune_*.json and tune_*.png in {args.out}")
  return recorded


def _tune_table(records_: Sequence[Any]) -> str:
  """A Markdown table of tuning records: start and best values, validation loss
  and personalized test accuracy (%) at both."""
  values = lambda p: ", ".join(f"{k}={v:.4g}" for k, v in p.values.items())
  lines = ["| algorithm | start | best (step) | validation loss: start, best "
           "| test accuracy: start, best |", "|---|---|---|---|---|"]
  for record in records_:
    start, best = record.path[0], record.best
    lines.append(f"| {record.algorithm} | {values(start)} | {values(best)} "
                 f"({best.step}) | {start.validation_loss:.4f}, "
                 f"{best.validation_loss:.4f} | {100 * start.test_accuracy:.2f}, "
                 f"{100 * best.test_accuracy:.2f} |")
  lines.append(f"Tuned by gradient on each client's held-out validation samples; "
               f"{records_[0].rounds} rounds per step, {records_[0].optimizer}; "
               "best = lowest validation loss.")
  return "\n".join(lines)


def _use_compilation_cache(args: argparse.Namespace) -> None:
  """JAX's persistent compilation cache in the user's cache directory: a rerun of the
  same configuration skips compilation (`--no-compilation-cache`: off)."""
  if args.no_compilation_cache or jax.config.jax_compilation_cache_dir:
    return
  jax.config.update("jax_compilation_cache_dir", compilation_cache_dir())
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    CACHE_MIN_COMPILE_SECONDS)


def _resume_notice(args: argparse.Namespace) -> None:
  if args.resume and not any(name.endswith(".ckpt") for name in os.listdir(args.out)):
    print(f"pflax-run: no checkpoint in {args.out}: starting from round 1",
          file=sys.stderr)


def _prepare(config: simulate.ExperimentConfig, args: argparse.Namespace
             ) -> dict[int, simulate.Setup]:
  """Each seed's federation (downloaded first with `--download`). A dataset that
  cannot be loaded or partitioned is an error without a traceback, its message
  (one line or several) as the library wrote it, a leading field named as its
  flag."""
  try:
    if args.download:
      datasets.load(config.dataset, data_dir=config.data_dir, download=True)
    return {seed: simulate.prepare(config, seed) for seed in args.seeds}
  except (FileNotFoundError, ImportError, ValueError) as e:
    raise _fail(_flag_message(e)) from None


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of `pflax-run` and `python -m pflax`."""
  args = _parser().parse_args(argv)
  try:
    with warnings.catch_warnings():
      warnings.showwarning = _one_line_warnings(warnings.showwarning)
      return _main(args, _given(argv))
  except KeyboardInterrupt:
    print("pflax-run: interrupted", file=sys.stderr)
    return 130


def _main(args: argparse.Namespace, given: set[str]) -> int:
  if "algorithms" in given and any(map(_importing, args.algorithms)):
    sys.path.append(os.getcwd())  # for --algorithms module:builder, never first
  if args.list_presets:
    print(presets.listing())
    return 0
  config = config_from_args(args, given)
  if args.print_config:
    print(json.dumps(_config_dict(config, args), indent=1))
    return 0
  if args.tune:
    _check_tune_flags(args, config)
  _check_run_flags(args)
  if args.flower:
    _check_flower_flags(args, config)
  _use_compilation_cache(args)
  if args.distributed:
    jax.distributed.initialize(coordinator_address=args.coordinator_address,
                               num_processes=args.num_processes,
                               process_id=args.process_id)
  _resume_notice(args)
  setups = _prepare(config, args)
  if args.tune:
    _tune(config, args, setups[args.seeds[0]])
    return 0
  recorded = _config_dict(config, args)
  runs = []
  if args.flower:
    runs, recorded["flower"] = _federate(config, args)
  else:
    for name in args.algorithms:
      if _swept(args):
        runs += _sweep(name, config, args, args.seeds, setups)
      else:
        for seed in args.seeds:
          runs += _sweep(name, config, args, [seed], setups)
  if jax.process_index() != 0:
    return 0
  results = records.Results(recorded, setups[args.seeds[0]].federation.counts,
                            tuple(runs))
  results.save(os.path.join(args.out, "results.json"))
  written = results.plot(args.out)
  print(results.table())
  print(f"wrote {os.path.join(args.out, 'results.json')} and {', '.join(written)}")
  return 0
