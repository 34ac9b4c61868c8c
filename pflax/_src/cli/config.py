"""The command line resolved into an `Invocation`: defaults <- `--preset` <-
`--config` file <- flags given <- `--set`, by pure functions that only read the
parsed arguments."""

import argparse
import dataclasses
import inspect
import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from pflax._src.cli import messages
from pflax._src.cli import parser
from pflax._src.cli import presets
from pflax._src.cli import privacy
from pflax._src.methods import registry
from pflax._src.simulation import experiment

_FLOWER_ENGINES = ("deployment", "simulation")
RUN_LEVEL = ("algorithms", "seeds", "devices", "sweep", "preset", "flower")
"""Keys of results.json's `config` that choose the runs, not the experiment."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Invocation:
  """What one `pflax-run` command runs: the experiment and every run-level
  choice, resolved once from the flags, `--preset` and `--config`. The checks
  and the run read this, never the `argparse.Namespace`, which nothing writes.

  The fields are the flags' (`--tune-steps`: `tune_steps`), but `config` holds
  the experiment's flags and `--set`, `tune` is `()` without `--tune`, and
  `compilation_cache` and `progress` are `--no-compilation-cache` and
  `--no-progress` negated.
  """
  config: experiment.ExperimentConfig
  algorithms: tuple[str, ...]
  seeds: tuple[int, ...]
  preset: str | None
  sweep: str | None
  values: tuple[float, ...]
  devices: int | None
  sequential: bool
  tune: tuple[str, ...]
  tune_steps: int
  tune_lr: float
  tune_validation: float
  flower: str | None
  flower_timeout: float
  flower_insecure: bool
  distributed: bool
  coordinator_address: str | None
  num_processes: int | None
  process_id: int | None
  download: bool
  out: str
  checkpoint_every: int
  resume: bool
  compilation_cache: bool
  progress: bool


_AS_GIVEN = ("preset", "sequential", "tune_steps", "tune_lr", "tune_validation",
             "flower_timeout", "flower_insecure", "distributed", "coordinator_address",
             "num_processes", "process_id", "download", "out", "checkpoint_every",
             "resume")
"""`Invocation` fields that are their flag's value, whatever the sources."""


def importing(name: Any) -> bool:
  """Whether running the algorithm `name` imports a module (`module:builder`)."""
  return isinstance(name, str) and ":" in name and name not in registry.METHODS


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
    raise messages.fail(f"--set {key}: {text!r} is not a {type(default).__name__}"
                        ) from None


def settable(name: str) -> dict[str, Any]:
  """`{key: default}` of what `--set` may set for one algorithm: its builder's
  keywords with plain defaults or `float | None = None` (`max_share`), and its
  optimizer's fields."""
  params = inspect.signature(experiment.resolve_builder(name)).parameters.values()
  keys = {p.name: p.default for p in params if p.kind == p.KEYWORD_ONLY
          and (isinstance(p.default, (bool, int, float, str))
               or (p.default is None and "float" in str(p.annotation)))}
  defaults = experiment.ExperimentConfig()
  keys.update({f: getattr(defaults, f) for f in experiment.OPTIMIZER_FIELDS})
  return keys


def apply_sets(config: experiment.ExperimentConfig, algorithms: Sequence[str],
               sets: Sequence[str]) -> experiment.ExperimentConfig:
  """`config` with the `--set KEY=VALUE` assignments (see the flag's help)."""
  hyperparameters = {k: dict(v) for k, v in config.hyperparameters.items()}
  optimizers = {k: dict(v) for k, v in config.optimizers.items()}
  for item in sets:
    key, sep, text = item.partition("=")
    if not sep:
      raise messages.fail(f"--set takes KEY=VALUE, got {item!r}")
    name, _, field = key.rpartition(".")
    targets = [name] if name else list(algorithms)
    if name and name not in algorithms:
      raise messages.fail(f"--set {key}: {name!r} is not one of --algorithms "
                          f"{' '.join(algorithms)}")
    hits = [t for t in targets if field in settable(t)]
    if not hits:
      valid = sorted({f"{t}.{k}" for t in targets for k in settable(t)})
      raise messages.fail(f"--set {key}: unknown key; valid keys: {', '.join(valid)}")
    for target in hits:
      default = settable(target)[field]
      table = optimizers if field in experiment.OPTIMIZER_FIELDS else hyperparameters
      table.setdefault(target, {})[field] = _typed(key, text, default)
  return dataclasses.replace(config, hyperparameters=hyperparameters,
                             optimizers=optimizers)


def _loaded(path: str) -> dict[str, Any]:
  """The `config` of a results.json (or a bare config), as written by pflax-run."""
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, ValueError) as e:
    raise messages.fail(f"--config {path}: {e}") from None
  config = data.get("config", data) if isinstance(data, dict) else None
  if not isinstance(config, dict):
    raise messages.fail(f"--config {path}: not a results.json (a JSON object, or one "
                        "with a 'config' object)")
  return config


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
    raise messages.fail(f"--config {path}: algorithms must be a list of names, got "
                        f"{algorithms!r}")
  imported = next(filter(importing, algorithms), None)
  if imported is not None and not command_line:
    raise messages.fail(f"--config names the algorithm {imported!r} (a module to "
                        "import); give it with --algorithms to run it")
  saved = dict(saved)
  for table in ("hyperparameters", "optimizers"):
    if isinstance(saved.get(table), dict):
      saved[table] = {name: entry for name, entry in saved[table].items()
                      if not importing(name) or name in command_line}
  return saved


def _saved(path: str, command_line: Sequence[str]) -> dict[str, Any]:
  """`--config`'s configuration, checked: no module imported (`_not_importing`),
  no key that is neither a field nor run-level."""
  saved = _not_importing(_loaded(path), path, command_line)
  unknown = set(saved) - set(parser.CONFIG_FIELDS) - {"optimizers", "hyperparameters",
                                                      *RUN_LEVEL}
  if unknown:
    raise messages.fail(f"--config {path}: unknown keys {', '.join(sorted(unknown))}")
  return saved


def _preset(name: str) -> presets.Preset:
  try:
    return presets.get(name)
  except ValueError as e:
    raise messages.fail(f"--preset: {e}") from None


def _preset_runs(preset: presets.Preset, given: Collection[str]) -> dict[str, Any]:
  """The algorithms and seeds of `--preset` that no flag given overrides."""
  return {key: list(getattr(preset, key)) for key in ("algorithms", "seeds")
          if key not in given}


def _saved_runs(saved: Mapping[str, Any], given: Collection[str]) -> dict[str, Any]:
  """The run-level choices of a `--config` file that no flag given overrides: its
  algorithms, seeds and devices, its sweep (`--values` with it), its Flower
  engine."""
  runs = {key: saved[key] for key in ("algorithms", "seeds", "devices")
          if key in saved and key not in given}
  sweep, flower = saved.get("sweep"), saved.get("flower")
  if sweep and "sweep" not in given:
    if not (isinstance(sweep, dict) and len(sweep) == 1
            and isinstance(next(iter(sweep.values())), list)):
      raise messages.fail(f"--config: sweep must be {{HYPERPARAMETER: [values]}}, got "
                          f"{sweep!r}")
    (runs["sweep"], runs["values"]), = sweep.items()
  if flower and "flower" not in given:
    if not isinstance(flower, dict) or flower.get("engine") not in _FLOWER_ENGINES:
      raise messages.fail(f"--config: flower must hold an engine of "
                          f"{_FLOWER_ENGINES}, got {flower!r}")
    runs["flower"] = flower["engine"]
  return runs


def _checked_runs(runs: Mapping[str, Any], config: experiment.ExperimentConfig) -> None:
  """One-line errors for run-level choices out of range (a `--config` file's
  included): algorithms, seeds, devices, and each `--values` entry of `--sweep`
  as its algorithm checks it."""
  algorithms, devices = runs["algorithms"], runs["devices"]
  if (not isinstance(algorithms, (list, tuple)) or not algorithms
      or not all(isinstance(a, str) for a in algorithms)):
    raise messages.fail(f"--algorithms must be a non-empty list of names, got "
                        f"{algorithms!r}")
  if devices is not None and (isinstance(devices, bool)
                              or not isinstance(devices, int)):
    raise messages.fail(f"--devices must be an integer >= 1, got {devices!r}")
  values = runs["values"]
  if not isinstance(values, (list, tuple)) or not all(
      isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
    raise messages.fail(f"--values must be numbers, got {values!r}")
  for name in algorithms:
    try:
      experiment.check_sweep(name, config, list(runs["seeds"]) if isinstance(
          runs["seeds"], (list, tuple)) else [runs["seeds"]], runs["sweep"], values)
    except ValueError as e:
      raise messages.fail(messages.flag_message(e)) from None


def _checked_config(values: Mapping[str, Any], algorithms: Sequence[str],
                    sets: Sequence[str]) -> experiment.ExperimentConfig:
  """The `ExperimentConfig` of `values` with `--set`, checked for `algorithms`;
  a setting it refuses is a one-line error naming its flag."""
  for table in ("hyperparameters", "optimizers"):
    entries = values.get(table, {})
    if not isinstance(entries, Mapping) or not all(
        isinstance(entry, Mapping) for entry in entries.values()):
      raise messages.fail(f"{table} must map algorithm names to keywords, got "
                          f"{entries!r}")
  try:
    config = apply_sets(experiment.ExperimentConfig(**values), algorithms, sets)
    experiment.warn_participation(config)
    experiment.check_algorithm_keys(config, algorithms)
    for name in algorithms:
      experiment.check_algorithm(name, config)
      if (config.heterogeneous and name in registry.METHODS
          and name not in experiment.HEAD_SHARING):
        raise ValueError(f"--heterogeneous needs algorithms that share a head "
                         f"({', '.join(experiment.HEAD_SHARING)}), got {name!r}")
  except (ValueError, TypeError) as e:
    raise messages.fail(messages.flag_message(e)) from None
  return config


def invocation_from_args(args: argparse.Namespace, given: Collection[str]
                         ) -> Invocation:
  """The invocation of the parsed command line `args`, of which the flags `given`
  were given (`parser.given_flags`): each source over the one before, defaults <-
  `--preset` <- `--config` <- flags given <- `--set`. `args` is only read."""
  runs = {key: getattr(args, key) for key in ("algorithms", "seeds", "devices",
                                               "sweep", "values", "flower")}
  base = {}
  if args.preset:
    preset = _preset(args.preset)
    base.update(preset.config)
    runs.update(_preset_runs(preset, given))
  if args.config:
    saved = _saved(args.config, args.algorithms if "algorithms" in given else ())
    base.update({k: v for k, v in saved.items() if k not in RUN_LEVEL})
    runs.update(_saved_runs(saved, given))
  flags = {f: getattr(args, f) for f in parser.CONFIG_FIELDS
           if f in given or f not in base}
  config = privacy.planned(
      _checked_config({**base, **flags}, runs["algorithms"], args.set))
  _checked_runs(runs, config)
  return Invocation(
      config=config, algorithms=tuple(runs["algorithms"]), seeds=tuple(runs["seeds"]),
      sweep=runs["sweep"], values=tuple(runs["values"]), devices=runs["devices"],
      flower=runs["flower"], tune=tuple(args.tune or ()),
      compilation_cache=not args.no_compilation_cache, progress=not args.no_progress,
      **{key: getattr(args, key) for key in _AS_GIVEN})


def config_dict(invocation: Invocation) -> dict[str, Any]:
  """`results.json`'s `config`: every value the run uses, the builders' and the
  optimizers' included, and the run-level choices (algorithms, seeds, sweep)."""
  config = invocation.config
  out = dataclasses.asdict(config)
  if config.precision == "float32":  # the default: results.json as before bf16 came
    del out["precision"]
  out["hyperparameters"] = {}
  out["optimizers"] = {}
  for name in invocation.algorithms:
    keys = settable(name)
    optimizer = {f: keys.pop(f) for f in experiment.OPTIMIZER_FIELDS}
    out["hyperparameters"][name] = {**keys, **config.hyperparameters.get(name, {})}
    out["optimizers"][name] = {**{f: getattr(config, f) for f in optimizer},
                               **config.optimizers.get(name, {})}
  out["algorithms"] = list(invocation.algorithms)
  out["preset"] = invocation.preset
  out["seeds"] = list(invocation.seeds)
  out["devices"] = invocation.devices
  if invocation.sweep:
    out["sweep"] = {invocation.sweep: list(invocation.values)}
  return privacy.recorded(out)
