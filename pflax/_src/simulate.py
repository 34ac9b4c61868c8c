"""Federated simulation: an experiment's configuration, its data, runs and sweeps.

`sweep` runs every (value, seed) pair of a grid through the one engine
(`pflax._src.engine`); `run` is a sweep of one seed, with checkpoints. Run r of
a sweep equals `run(algorithm, config_r, seed_r)` up to float rounding.
"""

import dataclasses
import functools
import importlib
import inspect
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import chex
import flax.linen as nn
import jax
import numpy as np
import optax

from pflax._src import algorithm as alg
from pflax._src import builders
from pflax._src import checkpoint as checkpoint_lib
from pflax._src import engine
from pflax._src import groups as groups_lib
from pflax._src import mapping
from pflax._src import models
from pflax._src import records
from pflax._src import sharding
from pflax._src.data import datasets
from pflax._src.data import dirichlet as dirichlet_lib
from pflax._src.data import federation as federation_lib
from pflax._src.data import groups as label_groups_lib
from pflax._src.data import pathological as pathological_lib

PARTITIONS = ("pathological", "dirichlet", "groups")
HEAD_SHARING = ("local", "fedavg", "cwfedavg", "fedclassavg", "fedsa")
"""pflax's algorithms whose server step and client context read only the output
layer, so `heterogeneous=True` can wrap them (`pflax.algorithms.heterogeneous`)."""
OPTIMIZER_FIELDS = ("optimizer", "lr", "momentum", "adam_b1", "grad_clip")
"""The fields of the clients' optimizer in `ExperimentConfig` (and its overrides)."""


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """Everything that defines an experiment, as plain values.

  Attributes:
    dataset, data_dir: the dataset (`pflax.data.load`).
    partition: "pathological" (`classes_per_client`), "dirichlet"
      (`dirichlet_alpha`) or "groups" (`iid_fraction`, FedReMa's s).
    clients, participation: M and the fraction of clients per round.
    faulty_clients: fraction of each round's participants that upload NaN.
    rounds, eval_every: rounds, and evaluation every this many rounds (and
      after the last).
    model: "auto" (the CNN for images of 16+ pixels, else the MLP), "cnn",
      "mlp".
    heterogeneous: clients use four architectures sharing the output layer
      (`pflax.algorithms.heterogeneous`).
    strategy: how clients are mapped in local training (`pflax.train`).
    local_epochs, batch_size: local training, shared by all algorithms.
    optimizer, lr, momentum, adam_b1, grad_clip: the clients' optimizer
      ("sgd" or "adam"), shared by all algorithms except as overridden.
    optimizers: per algorithm, overrides of the optimizer fields: FedClassAvg
      trains with Adam (its authors' optimizer, betas (0.5, 0.999), lr 1e-3):
      its supervised contrastive loss at temperature 100 on unnormalised
      features diverged under the common SGD base (9.8% accuracy on digits,
      against 99.8% with Adam).
    hyperparameters: per algorithm, keyword arguments of its builder (the
      others keep the builder's defaults).
  """
  dataset: str = "digits"
  data_dir: str | None = None
  partition: str = "pathological"
  clients: int = 20
  classes_per_client: int = 2
  dirichlet_alpha: float = 0.1
  iid_fraction: float = 0.2
  participation: float = 1.0
  faulty_clients: float = 0.0
  rounds: int = 40
  eval_every: int = 1
  model: str = "auto"
  heterogeneous: bool = False
  strategy: str = "auto"
  local_epochs: int = 5
  batch_size: int = 10
  optimizer: str = "sgd"
  lr: float = 0.05
  momentum: float = 0.0
  adam_b1: float = 0.9
  grad_clip: float | None = None
  optimizers: Mapping[str, Mapping[str, Any]] = dataclasses.field(
      default_factory=lambda: {"fedclassavg": {"optimizer": "adam", "lr": 1e-3,
                                               "adam_b1": 0.5}})
  hyperparameters: Mapping[str, Mapping[str, Any]] = dataclasses.field(
      default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Setup:
  """A prepared federation (host arrays) with its model."""
  federation: federation_lib.Federation
  model: nn.Module
  input_shape: tuple[int, ...]
  num_classes: int


def client_optimizer(optimizer: str = "sgd", lr: float = 0.05, momentum: float = 0.0,
                     adam_b1: float = 0.9, grad_clip: float | None = None
                     ) -> optax.GradientTransformation:
  """The clients' optimizer: SGD (optionally with momentum) or Adam (b2 0.999),
  with an optional clip of the gradient's global norm. `lr` may be traced."""
  alg.check_range("lr", lr, 0.0, open_low=True)
  alg.check_range("momentum", momentum, 0.0, 1.0)
  if optimizer == "sgd":
    opt = optax.sgd(lr, momentum=momentum or None)
  elif optimizer == "adam":
    opt = optax.adam(lr, b1=adam_b1, b2=0.999)
  else:
    raise ValueError(f"optimizer must be 'sgd' or 'adam', got {optimizer!r}.")
  if grad_clip:
    opt = optax.chain(optax.clip_by_global_norm(grad_clip), opt)
  return opt


def _partition(config: ExperimentConfig, labels: np.ndarray, num_classes: int,
               seed: int):
  if config.partition == "pathological":
    return pathological_lib.pathological(labels, config.clients,
                                         config.classes_per_client,
                                         num_classes=num_classes, seed=seed)
  if config.partition == "dirichlet":
    return dirichlet_lib.dirichlet(labels, config.clients, config.dirichlet_alpha,
                                   num_classes=num_classes, seed=seed,
                                   min_partition_size=min(10, len(labels)
                                                          // config.clients))
  if config.partition == "groups":
    return label_groups_lib.groups(labels, config.clients,
                                   iid_fraction=config.iid_fraction, seed=seed)
  raise ValueError(f"partition must be one of {PARTITIONS}, got {config.partition!r}.")


def _model_name(name: str, input_shape: tuple[int, ...]) -> str:
  """"auto": the papers' CNN for images of 16 pixels or more, else the MLP.

  On the 8x8 digits the CNN trains ~6x slower per step than the MLP on XLA-CPU
  and the main job must finish in minutes.
  """
  if name != "auto":
    return name
  return "cnn" if min(input_shape[:2]) >= 16 else "mlp"


def prepare(config: ExperimentConfig, seed: int) -> Setup:
  """Loads the dataset, partitions it over clients (75/25 split) and stacks it (NumPy)."""
  dataset = datasets.load(config.dataset, data_dir=config.data_dir)
  partition = _partition(config, dataset.labels, dataset.num_classes, seed)
  federation = federation_lib.federate(dataset.images, dataset.labels, partition,
                                       seed=seed, batch_size=config.batch_size)
  input_shape = tuple(dataset.images.shape[1:])
  model = models.get_model(_model_name(config.model, input_shape), dataset.num_classes,
                           input_shape)
  return Setup(federation, model, input_shape, dataset.num_classes)


Builder = Callable[..., alg.Algorithm]
"""`builder(model, optimizer, **hyperparameters) -> Algorithm`."""


def resolve_builder(name: str) -> Builder:
  """A builder by name: one of `pflax.algorithms.BUILDERS`, or `"module:function"`.

  Raises:
    ValueError: for an unknown name or a path that does not import.
  """
  if name in builders.BUILDERS:
    return builders.BUILDERS[name]
  if ":" not in name:
    raise ValueError(f"algorithm must be one of {tuple(builders.BUILDERS)} or "
                     f"'module:builder', got {name!r}.")
  module, _, attr = name.partition(":")
  try:
    builder = getattr(importlib.import_module(module), attr)
  except (ImportError, AttributeError) as e:
    raise ValueError(f"cannot import the builder {name!r}: {e}") from None
  if not callable(builder):
    raise ValueError(f"{name!r} is not a builder (a callable).")
  return builder


def sweepable(builder: Builder) -> tuple[str, ...]:
  """The hyperparameters a sweep can trace: "lr" (the clients' learning rate) and
  every keyword of `builder` with a float default."""
  params = inspect.signature(builder).parameters.values()
  return ("lr",) + tuple(p.name for p in params
                         if p.kind == p.KEYWORD_ONLY and isinstance(p.default, float))


@dataclasses.dataclass(frozen=True)
class _Build:
  """`build(value) -> Groups`: the algorithm of an experiment, hashable by value.

  `value` replaces the swept hyperparameter (`swept`) when it is not None.
  """
  builder: Builder
  model: nn.Module
  num_classes: int
  num_clients: int
  heterogeneous: bool
  optimizer: tuple[tuple[str, Any], ...]
  hyperparameters: tuple[tuple[str, Any], ...]
  swept: str | None

  def algorithm(self, model: nn.Module, value: Any) -> alg.Algorithm:
    opt, kw = dict(self.optimizer), dict(self.hyperparameters)
    if value is not None and self.swept is not None:
      (opt if self.swept == "lr" else kw)[self.swept] = value
    return self.builder(model, client_optimizer(**opt), **kw)

  def __call__(self, value: Any) -> groups_lib.Groups:
    build = functools.partial(self.algorithm, value=value)
    if self.heterogeneous:
      wrapped = groups_lib.heterogeneous(build, models.heterogeneous_family(
          self.num_classes))
      return groups_lib.as_groups(wrapped, self.model, self.num_clients)
    return groups_lib.as_groups(build(self.model), self.model, self.num_clients)


def _algorithm_name(algorithm: str | Builder) -> str:
  return algorithm if isinstance(algorithm, str) else algorithm.__name__


def _builder_arguments(algorithm: str | Builder, config: ExperimentConfig
                       ) -> tuple[Builder, dict[str, Any], dict[str, Any]]:
  """`(builder, optimizer fields, builder keywords)` of an algorithm in `config`."""
  name = _algorithm_name(algorithm)
  builder = resolve_builder(algorithm) if isinstance(algorithm, str) else algorithm
  optimizer = {f: getattr(config, f) for f in OPTIMIZER_FIELDS}
  optimizer.update(config.optimizers.get(name, {}))
  return builder, optimizer, dict(config.hyperparameters.get(name, {}))


def build_algorithm(algorithm: str | Builder, config: ExperimentConfig,
                    input_shape: tuple[int, ...], num_classes: int
                    ) -> tuple[alg.Algorithm, nn.Module]:
  """`(algorithm, model)` of an experiment, as a run builds them (one architecture),
  for inputs of `input_shape` in `num_classes` classes."""
  builder, optimizer, keywords = _builder_arguments(algorithm, config)
  model = models.get_model(_model_name(config.model, input_shape), num_classes,
                           input_shape)
  return builder(model, client_optimizer(**optimizer), **keywords), model


def _plan(algorithm: str | Builder, config: ExperimentConfig, setup: Setup,
          num_clients: int, strategy: str, swept: str | None) -> engine.Plan:
  """The engine's plan of an experiment (host checks of the builder included)."""
  builder, optimizer, keywords = _builder_arguments(algorithm, config)
  build = _Build(builder, setup.model, setup.num_classes, num_clients,
                 config.heterogeneous, tuple(sorted(optimizer.items())),
                 tuple(sorted(keywords.items())), swept)
  build.algorithm(setup.model, None)  # the builder's own checks, on the host
  return engine.Plan(build=build, num_clients=config.clients,
                     participation=config.participation,
                     fault_fraction=config.faulty_clients,
                     local_epochs=config.local_epochs, batch_size=config.batch_size,
                     strategy=strategy)


def check_config(config: ExperimentConfig) -> None:
  """Raises ValueError naming the first field of `config` out of its range."""
  def require(ok, field, expected):
    if not ok:
      raise ValueError(f"{field} must be {expected}, got {getattr(config, field)!r}.")
  require(config.clients >= 1, "clients", ">= 1")
  require(config.classes_per_client >= 1, "classes_per_client", ">= 1")
  require(config.dirichlet_alpha > 0 and math.isfinite(config.dirichlet_alpha),
          "dirichlet_alpha", "a finite number > 0")
  require(0.0 <= config.iid_fraction <= 1.0, "iid_fraction", "in [0, 1]")
  require(0.0 < config.participation <= 1.0, "participation", "in (0, 1]")
  require(0.0 <= config.faulty_clients < 1.0, "faulty_clients", "a fraction in [0, 1)")
  require(config.rounds >= 1, "rounds", ">= 1")
  require(config.eval_every >= 1, "eval_every", ">= 1")
  require(config.local_epochs >= 1, "local_epochs", ">= 1")
  require(config.batch_size >= 1, "batch_size", ">= 1")
  require(config.lr > 0 and math.isfinite(config.lr), "lr", "a finite number > 0")


def check_algorithm(algorithm: str | Builder, config: ExperimentConfig) -> None:
  """Raises ValueError if `algorithm`'s builder refuses its hyperparameters in `config`
  (builds it once with a placeholder model; nothing is compiled)."""
  builder, optimizer, keywords = _builder_arguments(algorithm, config)
  builder(models.MLP(2), client_optimizer(**optimizer), **keywords)


def _check_grid(seeds: Sequence[int], swept: str | None, values: Sequence[float],
                builder: Builder) -> None:
  if not seeds or any(not isinstance(s, (int, np.integer)) or not 0 <= s < 2**31
                      for s in seeds):
    raise ValueError(f"seeds must be a non-empty list of ints in [0, 2**31), got "
                     f"{list(seeds)!r}.")
  if swept is None:
    if values:
      raise ValueError("values given without a hyperparameter to sweep.")
    return
  if swept not in sweepable(builder):
    raise ValueError(f"hyperparameter must be one of {sweepable(builder)}, got "
                     f"{swept!r}.")
  if not values or any(not math.isfinite(v) for v in values):
    raise ValueError(f"values of {swept} must be a non-empty list of finite numbers, "
                     f"got {list(values)!r}.")


class _Grid:
  """A sweep ready to run: the plan's programs and the runs' placed inputs."""

  def __init__(self, algorithm: str | Builder, config: ExperimentConfig,
               seeds: Sequence[int], swept: str | None, values: Sequence[float],
               setups: Mapping[int, Setup] | None, mesh: jax.sharding.Mesh | None):
    check_config(config)
    builder = resolve_builder(algorithm) if isinstance(algorithm, str) else algorithm
    _check_grid(seeds, swept, values, builder)
    if (config.heterogeneous and isinstance(algorithm, str)
        and algorithm in builders.BUILDERS and algorithm not in HEAD_SHARING):
      raise ValueError(f"heterogeneous models need an algorithm that shares a head "
                       f"({', '.join(HEAD_SHARING)}), got {algorithm!r}.")
    if mesh is not None and config.heterogeneous:
      raise ValueError("a mesh splits one architecture's clients: heterogeneous=False.")
    setups = dict(setups or {})
    for s in seeds:
      if s not in setups:
        setups[s] = prepare(config, s)
    self.runs = [(v, s) for v in (values or [None]) for s in seeds]
    fed = federation_lib.stack_federations([setups[s].federation for _, s in self.runs])
    self.tests = fed.test_valid.sum(axis=2)
    if mesh is not None:
      sharding.check_mesh(mesh)
      fed = federation_lib.pad_clients(fed, mesh.shape[mesh.axis_names[0]])
    m = fed.num_samples.shape[1]
    strategy = sharding.strategy(config.strategy, sharded=mesh is not None)
    setup = setups[seeds[0]]
    self.plan = _plan(algorithm, config, setup, m, strategy, swept)
    for v in values:
      self.plan.build.algorithm(setup.model, v)  # each value's range, on the host
    self.programs = engine.programs(self.plan)
    groups = self.plan.build(None)
    feds = tuple(federation_lib.select_clients(fed, index) if len(groups.clients) > 1
                 else fed for index in groups.clients)
    values_arr = np.asarray([0.0 if v is None else v for v, _ in self.runs], np.float32)
    seeds_arr = np.asarray([s for _, s in self.runs], np.int32)
    inputs = (values_arr, feds, fed.counts, seeds_arr)
    if mesh is not None:
      inputs = sharding.place(inputs, sharding.client_shardings(inputs, mesh, m))
      self.programs = sharding.compiled(self.programs, mesh, m, *inputs)
    else:
      inputs = jax.device_put(inputs)
    self.values, self.feds, self.counts, self.seeds = inputs
    self.clients = np.arange(config.clients)

  def template(self) -> Any:
    """The shapes and dtypes of the runs' state."""
    return jax.eval_shape(self.programs.initial, self.values, self.feds, self.counts,
                          self.seeds)

  def start(self) -> Any:
    return self.programs.init(self.values, self.feds, self.counts, self.seeds)

  def round(self, carry: Any, t: int) -> tuple[Any, engine.RoundMetrics]:
    return self.programs.round(self.values, carry, self.feds, self.seeds, np.int32(t))

  def evaluate(self, carry: Any) -> tuple[dict[str, np.ndarray], np.ndarray]:
    correct, norms = self.programs.evaluate(self.values, carry, self.feds)
    return ({kind: sharding.to_host(c) for kind, c in correct.items()},
            sharding.to_host(norms))


def _round_records(t: int, metrics: engine.RoundMetrics, clients: np.ndarray
                   ) -> list[records.RoundRecord]:
  """Each run's record of round `t` (accuracies added when evaluated)."""
  losses, took_part, healthy, faulty = (sharding.to_host(x)[:, clients] for x in metrics)
  indices = lambda flags: tuple(int(i) for i in np.flatnonzero(flags))
  return [records.RoundRecord(
      round=t + 1,
      train_loss=float(np.sum(losses[r][healthy[r]]) / max(healthy[r].sum(), 1)),
      dropped_clients=indices(took_part[r] & ~healthy[r]),
      faulty_clients=indices(faulty[r]))
          for r in range(losses.shape[0])]


def _execute(grid: _Grid, name: str, config: ExperimentConfig,
             on_round: Callable[[int, list[records.RoundRecord]], None] | None,
             checkpoint: checkpoint_lib.Checkpointer | None) -> list[records.RunRecord]:
  """The round loop of a sweep: rounds, evaluations, records, checkpoints."""
  n = len(grid.runs)
  first, histories, spent = 0, [[] for _ in range(n)], 0.0
  restored = checkpoint and checkpoint.restore()
  if restored:
    carry, first, histories, spent = restored
  else:
    carry = grid.start()
  started = time.perf_counter()
  for t in range(first, config.rounds):
    carry, metrics = grid.round(carry, t)
    rounds = _round_records(t, metrics, grid.clients)
    if (t + 1) % config.eval_every == 0 or t + 1 == config.rounds:
      correct = grid.evaluate(carry)[0]
      rounds = [dataclasses.replace(rec, accuracies={
          kind: records.Accuracy.of(c[r, grid.clients], grid.tests[r])
          for kind, c in correct.items()}) for r, rec in enumerate(rounds)]
    for history, rec in zip(histories, rounds):
      history.append(rec)
    if on_round:
      on_round(t + 1, rounds)
    if checkpoint and checkpoint.due(t + 1):
      checkpoint.save(carry, t + 1, histories,
                      spent + time.perf_counter() - started)
  seconds = spent + time.perf_counter() - started
  norms = grid.evaluate(carry)[1][:, grid.clients]
  return [records.RunRecord(
      algorithm=name, seed=s, history=tuple(histories[r]), seconds=seconds,
      output_norms=norms[r],
      hyperparameter={} if v is None else {grid.plan.build.swept: float(v)})
          for r, (v, s) in enumerate(grid.runs)]


def sweep(algorithm: str | Builder, config: ExperimentConfig, seeds: Sequence[int], *,
          hyperparameter: str | None = None, values: Sequence[float] = (),
          setups: Mapping[int, Setup] | None = None,
          on_round: Callable[[int, list[records.RoundRecord]], None] | None = None,
          mesh: jax.sharding.Mesh | None = None,
          checkpoint_dir: str | None = None, checkpoint_every: int = 0,
          resume: bool = False) -> list[records.RunRecord]:
  """Runs every (value, seed) pair of a grid as one sweep (see the module docstring).

  Args:
    algorithm: a name of `pflax.algorithms.BUILDERS`, `"module:builder"`, or
      a builder `builder(model, optimizer, **hyperparameters) -> Algorithm`.
    config: the experiment; `config.strategy` maps the clients of all runs.
    seeds: the seeds; each gives its own partition, initial model and keys.
    hyperparameter: optionally one of `sweepable(builder)`: "lr" or a float
      keyword of the builder, checked by the builder for each value.
    values: the values of `hyperparameter` (the grid is values x seeds).
    setups: prepared federations by seed (default: `prepare`).
    on_round: called after every round with the round number and the records
      of that round, one per run.
    mesh: optionally a `jax.sharding.Mesh` whose first axis splits the clients
      (see `pflax.simulate.client_shardings`); M is padded with empty clients
      to a multiple of the axis size. Results equal the single-device ones up
      to float rounding.
    checkpoint_dir, checkpoint_every, resume: save the sweep's state every
      `checkpoint_every` rounds into `checkpoint_dir`; with `resume`, continue
      from the checkpoint there.

  Returns:
    One `RunRecord` per (value, seed), values outer. `seconds` is the sweep's
    round-loop time, shared by its runs.
  """
  if mesh is not None and checkpoint_dir:
    raise ValueError("checkpoints are not supported on a mesh: checkpoint_dir=None.")
  grid = _Grid(algorithm, config, seeds, hyperparameter, values, setups, mesh)
  name = _algorithm_name(algorithm)
  checkpoint = checkpoint_dir and checkpoint_lib.Checkpointer(
      os.path.join(checkpoint_dir, checkpoint_lib.file_name(name, grid.runs)),
      checkpoint_every, resume, template=grid.template,
      experiment={**dataclasses.asdict(config), "algorithm": name,
                  "runs": [[v, s] for v, s in grid.runs]})
  return _execute(grid, name, config, on_round, checkpoint or None)


def run(algorithm: str | Builder, config: ExperimentConfig, seed: int, *,
        setup: Setup | None = None,
        on_round: Callable[[records.RoundRecord], None] | None = None,
        checkpoint_dir: str | None = None, checkpoint_every: int = 0,
        resume: bool = False) -> records.RunRecord:
  """Runs one algorithm for `config.rounds` rounds with one seed: a sweep of one.

  Every random choice derives from `seed`: the partition, the initial model, and
  per round (via `fold_in(key, round)`) the participants, the local shuffles,
  the server's randomness and the faulty clients (`config.faulty_clients`, a
  stream of their own), so a resumed run equals an uninterrupted one.
  """
  each = on_round and (lambda t, rounds: on_round(rounds[0]))
  return sweep(algorithm, config, [seed], setups=setup and {seed: setup},
               on_round=each, checkpoint_dir=checkpoint_dir,
               checkpoint_every=checkpoint_every, resume=resume)[0]
