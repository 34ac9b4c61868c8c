"""Federated simulation: the runner of an experiment's runs and sweeps.

`sweep` runs every (value, seed) pair of a grid through the one engine
(`pflax._src.simulation.engine`); `sweep_settings` every (setting, seed) pair of
settings that differ only in their partition; `run` is a sweep of one seed, with
checkpoints. Run r of a sweep equals `run(algorithm, config_r, seed_r)` up to float
rounding.
"""

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from pflax._src.data import federation as federation_lib
from pflax._src.simulation import checkpoint as checkpoint_lib
from pflax._src.simulation import engine
from pflax._src.simulation import experiment
from pflax._src.simulation import faults as faults_lib
from pflax._src.simulation import records
from pflax._src.simulation import sharding
from pflax._src.training import parts as parts_lib


RunKey = tuple[str | None, int]
"""A run's setup in a grid: its setting (None in a `sweep`) and its seed."""


class _Grid:
  """A sweep ready to run: the plan's programs and the runs' placed inputs.

  Its runs are `(value, setting, seed)` triples, values outer, then settings,
  then seeds; each has the setup of its `(setting, seed)`.
  """

  def __init__(self, algorithm: str | experiment.Builder,
               config: experiment.ExperimentConfig, seeds: Sequence[int],
               swept: str | None, values: Sequence[float],
               setups: Mapping[RunKey, experiment.Setup] | None,
               mesh: jax.sharding.Mesh | None,
               new_setup: Callable[[str | None, int], experiment.Setup] | None = None,
               settings: Sequence[str | None] = (None,)):
    experiment.warn_participation(config)
    experiment.check_algorithm_keys(config, [algorithm])
    experiment.check_sweep(algorithm, config, seeds, swept, values)
    experiment.check_heterogeneous(algorithm, config)
    experiment.check_byzantine_bound(algorithm, config)
    if mesh is not None and config.heterogeneous:
      raise ValueError("a mesh splits one architecture's clients: heterogeneous=False.")
    setups = dict(setups or {})
    new_setup = new_setup or (lambda _, s: experiment.prepare(config, s))
    for key in ((setting, s) for setting in settings for s in seeds):
      if key not in setups:
        setups[key] = new_setup(*key)
    for setting in settings:
      experiment.check_setups(config, {s: setups[setting, s] for s in seeds})
    self.runs = [(v, setting, s) for v in (values or [None]) for setting in settings
                 for s in seeds]
    fed = federation_lib.stack_federations([setups[setting, s].federation
                                            for _, setting, s in self.runs])
    self.tests = fed.test_mask.sum(axis=2)
    if mesh is not None:
      sharding.check_mesh(mesh)
      fed = federation_lib.pad_clients(fed, mesh.shape[mesh.axis_names[0]])
    m = fed.num_samples.shape[1]
    strategy = sharding.strategy(config.strategy, sharded=mesh is not None)
    setup = setups[settings[0], seeds[0]]
    self.plan = dataclasses.replace(
        experiment.plan(algorithm, config, setup, m, strategy, swept),
        merge_runs=mesh is None)
    for v in values:
      self.plan.build.member(setup.model, v)  # each value's range, on the host
    self.programs = engine.programs(self.plan)
    groups = self.plan.build(None)
    feds = tuple(federation_lib.select_clients(fed, index) if len(groups.clients) > 1
                 else fed for index in groups.clients)
    values_arr = np.asarray([0.0 if v is None else v for v, _, _ in self.runs],
                            np.float32)
    seeds_arr = np.asarray([s for _, _, s in self.runs], np.int32)
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


def _check_not_all_dropped(t: int, metrics: engine.RoundMetrics, grid: "_Grid",
                           name: str) -> None:
  """Raises ValueError naming the run when every participant of round `t` was
  dropped (the run diverges: there is nothing to aggregate)."""
  took_part, healthy = (sharding.to_host(x)[:, grid.clients]
                        for x in (metrics.took_part, metrics.healthy))
  for r, (value, setting, seed) in enumerate(grid.runs):
    if took_part[r].any() and not healthy[r].any():
      swept = "" if value is None else f" {grid.plan.build.swept}={value:g}"
      where = name if setting is None else f"{name} {setting}"
      raise ValueError(faults_lib.all_dropped(f"round {t + 1} of {where} seed "
                                          f"{seed}{swept}"))


def _execute(grid: _Grid, name: str, config: experiment.ExperimentConfig,
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
    if not config.faulty_clients:
      _check_not_all_dropped(t, metrics, grid, name)
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
          for r, (v, _, s) in enumerate(grid.runs)]


def _check_one_source(setups: Any, dataset: experiment.Data | None,
                      model: nn.Module | None, parts: parts_lib.Parts | None) -> None:
  """Raises ValueError if both prepared `setups` and what prepares them are given."""
  if setups is not None and (dataset is not None or model is not None
                             or parts is not None):
    raise ValueError("give setups, or dataset/model/parts to prepare them, not both.")


def sweep(algorithm: str | experiment.Builder, config: experiment.ExperimentConfig,
          seeds: Sequence[int], *,
          hyperparameter: str | None = None, values: Sequence[float] = (),
          setups: Mapping[int, experiment.Setup] | None = None,
          on_round: Callable[[int, list[records.RoundRecord]], None] | None = None,
          mesh: jax.sharding.Mesh | None = None,
          checkpoint_dir: str | None = None, checkpoint_every: int = 0,
          resume: bool = False, dataset: experiment.Data | None = None,
          model: nn.Module | None = None,
          parts: parts_lib.Parts | None = None) -> list[records.RunRecord]:
  """Runs every (value, seed) pair of a grid as one sweep (see the module docstring).

  Args:
    algorithm: a name of `pflax.algorithms.METHODS`, `"module:builder"`, or
      a builder `builder(model, optimizer, **hyperparameters) -> Algorithm`.
    config: the experiment; `config.strategy` maps the clients of all runs.
    seeds: the seeds; each gives its own partition, initial model and keys.
    hyperparameter: optionally one of `sweepable(builder)`: "lr" or a float
      keyword of the builder, checked by the builder for each value.
    values: the values of `hyperparameter` (the grid is values x seeds).
    setups: prepared federations by seed (default: `prepare` with `dataset`,
      `model` and `parts`).
    on_round: called after every round with the round number and the records
      of that round, one per run.
    mesh: optionally a `jax.sharding.Mesh` whose first axis splits the clients
      (each client-axis leaf split over it); M is padded with empty clients
      to a multiple of the axis size. Results equal the single-device ones up
      to float rounding.
    checkpoint_dir, checkpoint_every, resume: save the sweep's state every
      `checkpoint_every` rounds into `checkpoint_dir`; with `resume`, continue
      from the checkpoint there.
    dataset: your data: a `pflax.data.Dataset` (e.g. `pflax.data.from_arrays`),
      partitioned by `config` for each seed, or a prepared
      `pflax.data.Federation`; None: `config.dataset`.
    model: your model, or a list of models for `heterogeneous=True`, as in
      `prepare` (None: `config.model`); `parts` declares its output layer etc.
      where it cannot be found (`pflax.models.Parts`).

  Returns:
    One `RunRecord` per (value, seed), values outer. `seconds` is the sweep's
    round-loop time, shared by its runs.

  Example:
    >>> import numpy as np, flax.linen as nn
    >>> from pflax import data, simulate
    >>> rng = np.random.default_rng(0)
    >>> ds = data.from_arrays(rng.normal(size=(200, 6)).astype(np.float32),
    ...                       rng.integers(0, 3, 200))
    >>> mlp = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(3)])
    >>> config = simulate.ExperimentConfig(clients=4, rounds=2, local_epochs=1)
    >>> runs = simulate.sweep("cwfedavg", config, [0, 1], dataset=ds, model=mlp)
    >>> [r.seed for r in runs], len(runs[0].history)
    ([0, 1], 2)
  """
  _check_one_source(setups, dataset, model, parts)
  if mesh is not None and checkpoint_dir:
    raise ValueError("checkpoints are not supported on a mesh: checkpoint_dir=None.")
  new_setup = lambda _, seed: experiment.prepare(config, seed, dataset=dataset,
                                                 model=model, parts=parts)
  grid = _Grid(algorithm, config, seeds, hyperparameter, values,
               setups and {(None, s): setup for s, setup in setups.items()}, mesh,
               new_setup)
  name = experiment.algorithm_name(algorithm)
  runs = [(v, s) for v, _, s in grid.runs]
  checkpoint = checkpoint_dir and checkpoint_lib.Checkpointer(
      os.path.join(checkpoint_dir, checkpoint_lib.file_name(name, runs)),
      checkpoint_every, resume, template=grid.template,
      experiment={**dataclasses.asdict(config), "algorithm": name,
                  "runs": [[v, s] for v, s in runs]}, rounds=config.rounds,
      start=grid.start, clients=config.clients)
  return _execute(grid, name, config, on_round, checkpoint or None)


def sweep_settings(
    algorithm: str | experiment.Builder,
    configs: Mapping[str, experiment.ExperimentConfig], seeds: Sequence[int], *,
    setups: Mapping[str, Mapping[int, experiment.Setup]] | None = None,
    on_round: Callable[[int, list[records.RoundRecord]], None] | None = None,
    mesh: jax.sharding.Mesh | None = None, dataset: experiment.Data | None = None,
    model: nn.Module | None = None, parts: parts_lib.Parts | None = None
) -> dict[str, list[records.RunRecord]]:
  """Runs every (setting, seed) pair as one sweep: settings whose configurations
  differ only in how the data are partitioned, side by side in one program.

  Each setting's seeds give their own partitions (by that setting's
  configuration); the sweep pads their samples to common lengths, as it does
  for the seeds of one setting.

  Args:
    algorithm: as in `sweep`.
    configs: `{setting: config}`; they must agree in every field but
      `PARTITION_FIELDS` (`partition`, `classes_per_client`, ...).
    seeds: the seeds of every setting.
    setups: prepared federations by setting and seed (default: `prepare` with
      `dataset`, `model` and `parts` and the setting's configuration).
    on_round: called after every round with the round number and the records
      of that round, one per run, settings outer and seeds inner.
    mesh, dataset, model, parts: as in `sweep`.

  Returns:
    A dict from each setting, in the order of `configs`, to its runs, one
    `RunRecord` per seed; each run equals that setting's `sweep` up to float
    rounding. `seconds` is the
    round-loop time of the one sweep, shared by every setting's runs.

  Raises:
    ValueError: before anything is prepared or compiled, naming the first field
      outside `PARTITION_FIELDS` in which `configs` differ and its value in each
      setting.

  Example:
    >>> import dataclasses, numpy as np, flax.linen as nn
    >>> from pflax import data, simulate
    >>> x = np.random.default_rng(1).normal(size=(160, 5)).astype(np.float32)
    >>> ds = data.from_arrays(x, (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0))
    >>> base = simulate.ExperimentConfig(clients=4, rounds=1, local_epochs=1)
    >>> configs = {"pathological": base,
    ...            "dirichlet": dataclasses.replace(base, partition="dirichlet")}
    >>> model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(3)])
    >>> out = simulate.sweep_settings("fedavg", configs, [0, 1], dataset=ds,
    ...                               model=model)
    >>> {s: [r.seed for r in runs] for s, runs in out.items()}
    {'pathological': [0, 1], 'dirichlet': [0, 1]}
  """
  experiment.check_settings(configs)
  _check_one_source(setups, dataset, model, parts)
  new_setup = lambda setting, seed: experiment.prepare(
      configs[setting], seed, dataset=dataset, model=model, parts=parts)
  given = {(setting, s): setup for setting, by_seed in (setups or {}).items()
           for s, setup in by_seed.items()}
  config = next(iter(configs.values()))
  grid = _Grid(algorithm, config, seeds, None, (), given, mesh, new_setup,
               list(configs))
  out = _execute(grid, experiment.algorithm_name(algorithm), config, on_round, None)
  return {setting: [rec for rec, (_, s, _) in zip(out, grid.runs) if s == setting]
          for setting in configs}


def run(algorithm: str | experiment.Builder, config: experiment.ExperimentConfig,
        seed: int, *,
        dataset: experiment.Data | None = None, model: nn.Module | None = None,
        parts: parts_lib.Parts | None = None, setup: experiment.Setup | None = None,
        on_round: Callable[[records.RoundRecord], None] | None = None,
        checkpoint_dir: str | None = None, checkpoint_every: int = 0,
        resume: bool = False) -> records.RunRecord:
  """Runs one algorithm for `config.rounds` rounds with one seed: a sweep of one.

  `dataset`, `model` and `parts` are your data and model, as in `sweep`; or
  `setup` a prepared one (`prepare`).

  Every random choice derives from `seed`: the partition, the initial model, and
  per round (via `fold_in(key, round)`) the participants, the local shuffles,
  the server's randomness and the faulty clients (`config.faulty_clients`, a
  stream of their own), so a resumed run equals an uninterrupted one.
  """
  each = on_round and (lambda t, rounds: on_round(rounds[0]))
  return sweep(algorithm, config, [seed], setups=setup and {seed: setup},
               on_round=each, checkpoint_dir=checkpoint_dir,
               checkpoint_every=checkpoint_every, resume=resume, dataset=dataset,
               model=model, parts=parts)[0]
