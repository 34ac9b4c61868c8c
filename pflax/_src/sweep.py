"""Many runs of one algorithm as one compiled program: seeds and a hyperparameter grid.

A sweep vmaps the whole simulation over a leading run axis, the idea of
`optax.inject_hyperparams`: the algorithm's structure (model, K, number of
clusters, local epochs) is static, while the seed and one numeric
hyperparameter are traced values, so S runs share one compiled initialisation,
one compiled round and one compiled evaluation. Run r of a sweep equals
`pflax.simulate.run(algorithm, config_r, seed_r)` up to float rounding: every
random choice derives from the seed exactly as in `run`, and the clients' data
of different seeds are padded to common lengths, which local training ignores
(`pflax.train.batch_schedule`).

Clients are mapped as in `pflax.train`: with "vmap" (accelerators) or "map" a
round of all runs is one program; with "loop" (the default on CPU, where
vmapped clients train slower than a loop) the S x M clients of all runs are one
client axis of the threaded loop, between a run-vmapped program that gathers
their inputs and one that aggregates.
"""

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from pflax._src import algorithms as algos
from pflax._src import models
from pflax._src import simulate
from pflax._src import train as train_lib
from pflax._src import tree as tree_lib

SWEEPABLE = {
    "lr": (0.0, None), "fedprox_mu": (0.0, None), "wdr_coef": (0.0, None),
    "fedclassavg_rho": (0.0, None), "fedclassavg_lr": (0.0, None),
    "supcon_temperature": (0.0, None), "fedsa_cv_threshold": (0.0, None),
    "fedsa_sim_threshold": (-1.0, 1.0), "feddwa_alpha": (0.0, 1.0),
    "feddwa_lambda": (0.0, None), "feddwa_temperature": (0.0, None),
    "fedrema_delta": (0.0, 1.0), "fedrema_temperature": (0.0, None),
}
"""Numeric hyperparameters a sweep can trace, with their valid ranges."""


class RoundMetrics(NamedTuple):
  """Per-client outcome of one round `(..., M)`: losses, participation, health,
  injected faults."""
  losses: chex.Array
  took_part: chex.Array
  healthy: chex.Array
  faulty: chex.Array


class _Programs(NamedTuple):
  """A sweep's jitted steps, each over the leading run axis of its arguments.

  `init(values, seeds, feds) -> carry`, `round(values, carry, feds, seeds, t)
  -> (carry, RoundMetrics)` and `evaluate(values, carry, feds) -> ({kind:
  (S, M) correct test samples per client}, output_norms)`, one kind per
  model of `Algorithm.evaluate`.
  """
  init: Callable[..., Any]
  round: Callable[..., Any]
  evaluate: Callable[..., Any]


def sweep_strategy(strategy: str, sharded: bool = False) -> str:
  """Client mapping inside a sweep: `pflax.train`'s strategies, resolved.

  "auto" is the backend's default (`pflax.train.default_strategy`: "loop" on
  CPU, "vmap" on accelerators), or "vmap" on a mesh, where the whole round is
  one program partitioned over the devices; "loop" cannot be sharded.
  """
  if sharded and strategy == "loop":
    raise ValueError("a sharded sweep maps clients inside one program: strategy "
                     f"must be 'auto', 'vmap' or 'map', got {strategy!r}.")
  if sharded and strategy == "auto":
    return "vmap"
  return train_lib.resolve_strategy(strategy)


def _with_value(hp: algos.Hyperparameters, field: str | None,
                value: chex.Array) -> algos.Hyperparameters:
  return hp if field is None else dataclasses.replace(hp, **{field: value})


class RoundInputs(NamedTuple):
  """What one run's round trains on, and what its server step needs after."""
  clients: algos.ClientInputs
  chosen: chex.Array | None
  took_part: chex.Array
  server_key: chex.PRNGKey
  faulty: chex.Array | None = None


def round_inputs(algorithm: algos.Algorithm, participation: float, num_clients: int,
                 carry: tuple[Any, Any], fed: algos.Federation,
                 round_key: chex.PRNGKey, t: chex.Array,
                 fault_fraction: float = 0.0) -> RoundInputs:
  """Round `t`'s participants and their training inputs, for one run.

  Keys, participants and faulty clients (`fault_fraction` of the
  participants upload NaN) are those of `pflax.simulate.run` for a single
  architecture group. Clients from `num_clients` on are padding (see
  `pad_clients`): never chosen. With full participation nothing is gathered
  (`chosen` is None).
  """
  state, opt_state = carry
  sample_key, train_key, server_key = simulate.round_keys(round_key, t)
  m = fed.num_samples.shape[0]
  chosen = simulate.participants(jax.random.fold_in(sample_key, 0), num_clients,
                                 participation)
  if chosen.shape[0] == num_clients:
    chosen, took_part = None, jnp.arange(m) < num_clients
  else:
    took_part = simulate.chosen_mask(m, chosen)
  clients = algos.client_inputs(algorithm, state, opt_state, fed, chosen,
                                jax.random.fold_in(train_key, 0))
  count = simulate.num_faulty(fault_fraction,
                              num_clients if chosen is None else chosen.shape[0])
  faulty = (simulate.faulty_clients(
      jax.random.fold_in(sample_key, simulate.FAULT_STREAM), took_part, count)
            if count else jnp.zeros_like(took_part))
  return RoundInputs(clients, chosen, took_part, server_key, faulty)


def round_outputs(algorithm: algos.Algorithm, carry: tuple[Any, Any],
                  inputs: RoundInputs, result: train_lib.ClientResult
                  ) -> tuple[tuple[Any, Any], RoundMetrics]:
  """The server step of one run after local training: new carry and metrics.

  Clients that did not take part or uploaded non-finite values (the injected
  faults among them) are treated as absent (`pflax.algorithms.drop_unhealthy`);
  a round without any healthy client keeps the state.
  """
  state, opt_before = carry
  trained, opt_after, losses = algos.client_outputs(algorithm, state, opt_before,
                                                    inputs.chosen, result)
  trained = simulate.upload_faults(trained, inputs.faulty)
  healthy = simulate.healthy(inputs.took_part, trained)
  trained, opt_state = algos.drop_unhealthy(algorithm, state, trained, opt_before,
                                            opt_after, healthy)
  new = algorithm.server_update(state, trained, healthy, inputs.server_key)
  state = algos.keep_if_nobody(healthy, new, state)
  return (state, opt_state), RoundMetrics(losses, inputs.took_part, healthy,
                                          inputs.faulty)


def _merge_runs(tree: Any) -> Any:
  """Leaves `(S, C, ...)` -> `(S * C, ...)`: the runs' clients as one client axis."""
  return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), tree)


def _split_runs(tree: Any, runs: int) -> Any:
  """Inverse of `_merge_runs`."""
  return jax.tree.map(lambda x: x.reshape(runs, -1, *x.shape[1:]), tree)


def _warm_inputs(algorithm: algos.Algorithm, carry: tuple[Any, Any],
                 fed: algos.Federation, seed: chex.Array) -> RoundInputs:
  """FedClassAvg's warm-up epoch: every client trains, as in `simulate.run`."""
  everyone = jnp.arange(fed.num_samples.shape[0])
  return RoundInputs(algos.client_inputs(algorithm, *carry, fed, everyone,
                                         simulate.run_keys(seed)[1]),
                     everyone, None, None)


def _warm_outputs(algorithm: algos.Algorithm, carry: tuple[Any, Any],
                  inputs: RoundInputs, result: train_lib.ClientResult
                  ) -> tuple[Any, Any]:
  """The warmed-up parameters become the state's; no aggregation."""
  state, opt_state = carry
  trained, _, _ = algos.client_outputs(algorithm, state, opt_state, inputs.chosen,
                                       result)
  trained, _ = algos.drop_unhealthy(algorithm, state, trained, opt_state, opt_state,
                                    tree_lib.finite_clients(trained))
  return {**state, "params": trained}, opt_state


def _phase(build: Callable[[chex.Array], tuple[algos.Algorithm, Any]], strategy: str,
           epochs: int, pre: Callable[..., RoundInputs], post: Callable[..., Any],
           in_axes: tuple[int | None, ...]) -> Callable[..., Any]:
  """A local-training phase of all runs: `pre`, the clients' training, `post`.

  `build(value) -> (algorithm, hyperparameters)`; `pre(algorithm, carry, *args)`
  and `post(algorithm, carry, inputs, result)` are per run. Returns a function
  of `(values, carry, *args)` with a leading run axis (`in_axes` for `carry`
  and `args`): one jitted program for "vmap" and "map"; for "loop" the clients
  of all runs trained by the threaded loop between two jitted programs.
  """
  def train_one(value, *client):
    algorithm, h = build(value)
    return train_lib.train_client(algorithm.loss, algorithm.optimizer, *client,
                                  epochs=epochs, batch_size=h.batch_size,
                                  unroll=algorithm.unroll)

  if strategy != "loop":
    def whole(value, carry, *args):
      algorithm, _ = build(value)
      inputs = pre(algorithm, carry, *args)
      train = train_lib.map_clients(functools.partial(train_one, value), strategy)
      return post(algorithm, carry, inputs, train(*inputs.clients))
    return jax.jit(jax.vmap(whole, (0, *in_axes)))

  @jax.jit
  def before(values, carry, *args):
    inputs = jax.vmap(lambda value, *a: pre(build(value)[0], *a), (0, *in_axes))(
        values, carry, *args)
    per_run = jax.tree.leaves(inputs.clients)[0].shape[1]
    return (inputs._replace(clients=None), _merge_runs(inputs.clients),
            jnp.repeat(values, per_run))

  @jax.jit
  def after(values, carry, inputs, result):
    result = _split_runs(result, values.shape[0])
    return jax.vmap(lambda value, *a: post(build(value)[0], *a))(values, carry,
                                                                inputs, result)

  loop = train_lib.map_clients(train_one, "loop")

  def run_phase(values, carry, *args):
    inputs, clients, client_values = before(values, carry, *args)
    return after(values, carry, inputs, loop(client_values, *clients))
  return run_phase


@functools.lru_cache(maxsize=32)
def _programs(name: str, model: Any, hp: algos.Hyperparameters, strategy: str,
              input_shape: tuple[int, ...], field: str | None,
              participation: float, num_clients: int,
              fault_fraction: float = 0.0) -> _Programs:
  """Jitted, run-vmapped init, round and evaluation of one algorithm.

  With "vmap" or "map" a round is one program over all runs. With "loop" the
  clients of all runs train as one client axis of `pflax.train`'s threaded
  loop, between two run-vmapped programs: the participants' inputs before it
  and the server steps after it. Each client's program is the same in both.
  """

  def build(value):
    h = _with_value(hp, field, value)
    return algos.get_algorithm(name, model, h, input_shape), h

  def start(value, seed, fed):
    algorithm, _ = build(value)
    init_key = simulate.run_keys(seed)[0]
    m = fed.num_samples.shape[0]
    params = models.init_stacked(model, init_key, fed.x[0, :1], m, same_init=True)
    state = algorithm.init(params, fed, init_key)
    return state, algos.init_opt_state(algorithm, state)

  def round_pre(algorithm, carry, fed, seed, t):
    return round_inputs(algorithm, participation, num_clients, carry, fed,
                        simulate.run_keys(seed)[2], t, fault_fraction)

  starting = jax.jit(jax.vmap(start))
  warm = (_phase(build, strategy, hp.fedclassavg_warmup_epochs, _warm_inputs,
                 _warm_outputs, (0, 0, 0))
          if name == "fedclassavg" and hp.fedclassavg_warmup_epochs else None)

  def init(values, seeds, feds):
    carry = starting(values, seeds, feds)
    return carry if warm is None else warm(values, carry, feds, seeds)

  round_ = _phase(build, strategy, hp.local_epochs, round_pre, round_outputs,
                  (0, 0, 0, None))

  apply = lambda p, x: model.apply({"params": p}, x)
  count = train_lib.map_clients(functools.partial(train_lib.evaluate_client, apply),
                                "vmap" if strategy == "loop" else strategy)

  def evaluate(value, carry, fed):
    held = build(value)[0].evaluate(carry[0])
    correct = {kind: count(stacked, fed.test_x, fed.test_y, fed.test_valid)
               for kind, stacked in held.items()}
    return correct, simulate.output_norms(held["personalized"])

  return _Programs(init=init, round=round_, evaluate=jax.jit(jax.vmap(evaluate)))


def client_shardings(tree: Any, mesh: jax.sharding.Mesh, num_clients: int) -> Any:
  """`NamedSharding`s of a run-stacked tree: axis 1 over the `clients` mesh axis.

  Leaves `(S, M, ...)` with `M = num_clients` are split over the devices of
  `mesh.axis_names[0]`; all other leaves (global models, class models,
  scalars per run) are replicated. A leaf whose second axis merely equals M
  by coincidence (K = M class models) is split too, which is correct, only
  laid out differently.
  """
  axis = mesh.axis_names[0]

  def spec(leaf):
    split = len(leaf.shape) >= 2 and leaf.shape[1] == num_clients
    return jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(None, axis) if split
        else jax.sharding.PartitionSpec())

  return jax.tree.map(spec, tree)


def _compiled(programs: _Programs, mesh: jax.sharding.Mesh | None, value: Any,
              seed: Any, feds: algos.Federation) -> _Programs:
  """The programs; on a mesh, jitted so that the client axis stays split."""
  if mesh is None:
    return programs
  m = feds.num_samples.shape[1]
  carry = client_shardings(jax.eval_shape(programs.init, value, seed, feds), mesh, m)
  metrics = client_shardings(RoundMetrics(*[feds.num_samples] * 4), mesh, m)
  return _Programs(init=jax.jit(programs.init, out_shardings=carry),
                   round=jax.jit(programs.round, out_shardings=(carry, metrics)),
                   evaluate=jax.jit(programs.evaluate))


def place(tree: Any, shardings: Any) -> Any:
  """Host arrays as global arrays with the given shardings (also across hosts).

  Every process holds the same host copy (same data, same seeds) and
  contributes the shards of its own devices.
  """
  def put(x, sharding):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
  return jax.tree.map(put, tree, shardings)


def pad_clients(fed: algos.Federation, multiple: int) -> algos.Federation:
  """Appends empty clients (no samples, zero counts) up to a multiple of `multiple`.

  Padded clients sit on the client axis only so that it divides the devices:
  they are never chosen, aggregated nor evaluated.
  """
  m = fed.num_samples.shape[-1]
  return jax.tree.map(lambda x: _pad_axis1(x, m + -m % multiple), fed)


def _pad_axis1(x: chex.Array, length: int) -> chex.Array:
  """Zero-pads axis 1 (samples of `(M, L, ...)`, clients of `(S, M, ...)`) to `length`."""
  return jnp.pad(x, ((0, 0), (0, length - x.shape[1])) + ((0, 0),) * (x.ndim - 2))


def stack_federations(feds: Sequence[algos.Federation]) -> algos.Federation:
  """Stacks federations on a leading run axis, padding samples to common lengths.

  All must have the same clients, classes and input shape; padded samples are
  invalid (`valid` False) and are never trained on nor evaluated.
  """
  train_len = max(f.x.shape[1] for f in feds)
  test_len = max(f.test_x.shape[1] for f in feds)
  pad = lambda f: f._replace(
      x=_pad_axis1(f.x, train_len), y=_pad_axis1(f.y, train_len),
      valid=_pad_axis1(f.valid, train_len), test_x=_pad_axis1(f.test_x, test_len),
      test_y=_pad_axis1(f.test_y, test_len),
      test_valid=_pad_axis1(f.test_valid, test_len))
  return jax.tree.map(lambda *xs: jnp.stack(xs), *[pad(f) for f in feds])


def _check_grid(seeds: Sequence[int], hyperparameter: str | None,
                values: Sequence[float]) -> None:
  if not seeds or any(not isinstance(s, (int, np.integer)) or not 0 <= s < 2**31
                      for s in seeds):
    raise ValueError(f"seeds must be a non-empty list of ints in [0, 2**31), got "
                     f"{list(seeds)!r}.")
  if hyperparameter is None:
    if values:
      raise ValueError("values given without a hyperparameter to sweep.")
    return
  if hyperparameter not in SWEEPABLE:
    raise ValueError(f"hyperparameter must be one of {sorted(SWEEPABLE)}, got "
                     f"{hyperparameter!r}.")
  low, high = SWEEPABLE[hyperparameter]
  bad = [v for v in values if not (math.isfinite(v) and (low is None or v >= low)
                                   and (high is None or v <= high))]
  if not values or bad:
    raise ValueError(f"values of {hyperparameter} must be a non-empty list of finite "
                     f"numbers in [{low}, {high if high is not None else 'inf'}], "
                     f"got {list(values)!r}.")


def _runs(seeds: Sequence[int], values: Sequence[float]) -> list[tuple[float, int]]:
  """The `(value, seed)` pairs of a sweep, values outer (value 0.0 if none)."""
  return [(v, s) for v in (values or [0.0]) for s in seeds]


class Grid(NamedTuple):
  """A sweep ready to run: compiled programs, the runs' placed inputs, and the
  `(S, M)` test samples of each run's clients."""
  programs: _Programs
  feds: algos.Federation
  values: chex.Array
  seeds: chex.Array
  tests: np.ndarray


def _check_mesh(mesh: jax.sharding.Mesh) -> None:
  axis = mesh.axis_names[0]
  if mesh.axis_types[0] != jax.sharding.AxisType.Auto:
    raise ValueError(f"mesh axis {axis!r} must be of type AxisType.Auto (the compiler "
                     "places the collectives), e.g. jax.make_mesh((n,), ('clients',), "
                     f"axis_types=(jax.sharding.AxisType.Auto,)); got {mesh.axis_types[0]}.")


def prepare_grid(algorithm: str, config: simulate.ExperimentConfig,
                 seeds: Sequence[int], *, hyperparameter: str | None = None,
                 values: Sequence[float] = (),
                 setups: dict[int, simulate.Setup] | None = None,
                 mesh: jax.sharding.Mesh | None = None) -> Grid:
  """Validates a sweep, stacks (and on a mesh pads and places) its inputs, jits it.

  Arguments as in `sweep`. The runs are `(value, seed)` pairs, values outer.
  """
  _check_grid(seeds, hyperparameter, values)
  if config.heterogeneous:
    raise ValueError("sweeps need one architecture: heterogeneous=False.")
  if mesh is not None:
    _check_mesh(mesh)
  strategy = sweep_strategy(config.strategy, sharded=mesh is not None)
  simulate.check_faults(config.faulty_clients)
  setups = dict(setups or {})
  for s in seeds:
    setups.setdefault(s, simulate.prepare(config, s))
  grid = _runs(seeds, values)
  setup = setups[seeds[0]]
  programs = _programs(algorithm, setup.model, config.hp, strategy, setup.input_shape,
                       hyperparameter, config.participation, config.clients,
                       config.faulty_clients)
  feds = stack_federations([setups[s].federation for _, s in grid])
  value_arr = np.asarray([v for v, _ in grid], np.float32)
  seed_arr = np.asarray([s for _, s in grid], np.int32)
  tests = np.asarray(jnp.sum(feds.test_valid, axis=2))
  if mesh is not None:
    feds = pad_clients(feds, mesh.shape[mesh.axis_names[0]])
    m = feds.num_samples.shape[1]
    feds = place(feds, client_shardings(feds, mesh, m))
    value_arr, seed_arr = place((value_arr, seed_arr),
                                client_shardings((value_arr, seed_arr), mesh, m))
  return Grid(_compiled(programs, mesh, value_arr, seed_arr, feds), feds, value_arr,
              seed_arr, tests)


def sweep(algorithm: str, config: simulate.ExperimentConfig, seeds: Sequence[int], *,
          hyperparameter: str | None = None, values: Sequence[float] = (),
          setups: dict[int, simulate.Setup] | None = None,
          on_round: Callable[[int, list[dict[str, Any]]], None] | None = None,
          mesh: jax.sharding.Mesh | None = None) -> list[dict[str, Any]]:
  """Runs every (value, seed) pair of a grid as one sweep (see the module docstring).

  Args:
    algorithm: one of `pflax.algorithms.NAMES`.
    config: the experiment; `config.strategy` maps the clients of all runs
      (see `sweep_strategy`). Heterogeneous models are not supported in sweeps.
    seeds: the seeds; each gives its own partition, initial model and keys.
    hyperparameter: optionally a field of `Hyperparameters` in `SWEEPABLE`.
    values: the values of `hyperparameter` (the grid is values x seeds).
    setups: prepared federations by seed (default: `simulate.prepare`).
    on_round: called after every round with the round number and the records
      of that round, one per run.
    mesh: optionally a `jax.sharding.Mesh` whose first axis splits the clients:
      data, states, optimizer states and per-client metrics are placed with
      `NamedSharding`s over it (`client_shardings`), the same program runs
      under GSPMD (the compiler inserts the aggregations' collectives), and M
      is padded with empty clients to a multiple of the axis size. Results
      equal the single-device ones up to float rounding.

  Returns:
    One run record per (value, seed), values outer, in the format of
    `pflax.simulate.run`, plus `"hyperparameter": {name: value}` when swept.
    `seconds` is the sweep's round-loop time, shared by its runs.
  """
  g = prepare_grid(algorithm, config, seeds, hyperparameter=hyperparameter,
                   values=values, setups=setups, mesh=mesh)
  programs, feds, value_arr, seed_arr, tests = g
  grid = _runs(seeds, values)
  clients = np.arange(config.clients)
  carry = programs.init(value_arr, seed_arr, feds)
  histories: list[list[dict[str, Any]]] = [[] for _ in grid]
  started = time.perf_counter()
  for t in range(config.rounds):
    carry, metrics = programs.round(value_arr, carry, feds, seed_arr, jnp.int32(t))
    losses, took_part, healthy, faulty = (_to_host(x) for x in metrics)
    records = [simulate.round_record(t, losses[r], took_part[r], healthy[r], faulty[r],
                                     clients)
               for r in range(len(grid))]
    if (t + 1) % config.eval_every == 0 or t + 1 == config.rounds:
      correct = programs.evaluate(value_arr, carry, feds)[0]
      for kind in (k for k in algos.EVALUATED if k in correct):
        counts = _to_host(correct[kind])[:, :config.clients]
        for r, record in enumerate(records):
          record.update(simulate.accuracies(kind, counts[r], tests[r]))
    for history, record in zip(histories, records):
      history.append(record)
    if on_round:
      on_round(t + 1, records)
  seconds = time.perf_counter() - started
  norms = _to_host(programs.evaluate(value_arr, carry, feds)[1])[:, :config.clients]
  return [dict(simulate.run_record(algorithm, s, histories[r], norms[r], seconds),
               **({"hyperparameter": {hyperparameter: v}} if hyperparameter else {}))
          for r, (v, s) in enumerate(grid)]


def _to_host(x: chex.Array) -> np.ndarray:
  """A global array as a NumPy array on every process."""
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))
