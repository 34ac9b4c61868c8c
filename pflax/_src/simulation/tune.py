"""Differentiable rounds: hypergradients of a held-out validation loss, and a tuner.

A round of the engine (`pflax._src.simulation.engine`) is a pure JAX function of the
algorithm's float hyperparameters: the builder is called inside the traced
function with traced values, so `jax.grad` reaches through R rounds of local
training and aggregation to the clients' validation loss. `make_task` holds
out part of each client's training split for validation (never its test
split); `validation_loss` is the differentiable run; `tune` runs gradient
steps on chosen keywords with an optax optimizer in an unconstrained
parametrization and records the path (`TuneRecord`).

Only keywords whose effect on the models is smooth have a useful gradient
(`DIFFERENTIABLE`, refused otherwise with a ValueError): a keyword that acts
only through a piecewise-constant decision (FedReMa's MDS cut and CCP
threshold, FedSA's thresholds and cluster counts, the participants) has a
gradient of exactly zero almost everywhere and none where the decision flips.
"""

import dataclasses
import functools
import inspect
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from pflax._src.data import clients as clients_lib
from pflax._src.data import federation as federation_lib
from pflax._src.data import partition as partition_lib
from pflax._src.data import split as split_lib
from pflax._src.methods import algorithm as alg
from pflax._src.methods import registry
from pflax._src.simulation import engine
from pflax._src.simulation import experiment
from pflax._src.simulation import groups as groups_lib
from pflax._src.simulation import plots
from pflax._src.simulation import records
from pflax._src.training import losses as losses_lib
from pflax._src.training import mapping
from pflax._src.training import train as train_lib

DIFFERENTIABLE: Mapping[str, tuple[str, ...]] = {
    name: method.differentiable for name, method in registry.METHODS.items()
    if method.differentiable is not None}
"""The keywords with a useful hypergradient, per built-in algorithm ("lr" is the
clients' learning rate; the others are the builder's keywords): each method's
`Method.differentiable`, in its file.

FedProx's `mu`, cwFedAvg's `wdr_coef`, FedClassAvg's `rho` and FedDWA's `lam`
weight terms of the local loss; FedDWA's `alpha` and `temperature` weight the
exclusive models' mix. Each is checked against finite differences
(tests/test_tune.py; FedClassAvg without its warm-up, which the differentiable
run does not run). Left out, with their reason in `NOT_DIFFERENTIABLE`:
FedReMa's `temperature` and `delta`, FedSA's thresholds, FedClassAvg's SupCon
temperatures (not checked yet), robust options (`trim_fraction`, `max_share`,
`clip_norm`)."""

NOT_DIFFERENTIABLE: Mapping[str, Mapping[str, str]] = {
    name: method.not_differentiable for name, method in registry.METHODS.items()
    if method.not_differentiable}
"""Why a float keyword of a built-in algorithm is refused: each method's
`Method.not_differentiable`."""

_ROBUST = {"trim_fraction": "it decides which coordinates are cut (order statistics)",
           "max_share": "a cap (a piecewise-linear clip) on the clients' weights",
           "clip_norm": "a clip of each update's norm, not tested yet",
           "radius": "centered clipping's clip of each update, not tested yet"}

PARAMETRIZATIONS = ("log", "logit", "identity")
"""How `tune` maps a keyword to an unconstrained value: "log" (positive values),
"logit" (fractions in (0, 1)), "identity"."""

FRACTIONS = frozenset({"alpha"})
"""Keywords of the built-in algorithms in (0, 1): tuned as logits; all others of
`DIFFERENTIABLE` are positive and tuned as logs."""


def differentiable_keywords(algorithm: str | experiment.Builder) -> tuple[str, ...]:
  """The keywords `validation_loss` differentiates for `algorithm`: its row of
  `DIFFERENTIABLE`, or for a builder of your own "lr" and its float keywords
  (`pflax.simulate.sweepable`; their gradients are your builder's to make sense
  of)."""
  if isinstance(algorithm, str) and algorithm in DIFFERENTIABLE:
    return DIFFERENTIABLE[algorithm]
  return experiment.sweepable(experiment.resolve_builder(algorithm)
                            if isinstance(algorithm, str) else algorithm)


def check_keys(algorithm: str | experiment.Builder, keys: Sequence[str]
               ) -> tuple[str, ...]:
  """`keys` as a tuple, after checking each is differentiable for `algorithm`.

  Raises:
    ValueError: naming the first keyword that is not, why (when known) and the
      allowed ones.
  """
  allowed = differentiable_keywords(algorithm)
  name = experiment.algorithm_name(algorithm)
  keys = tuple(keys)
  if not keys:
    raise ValueError(f"keys must name at least one of {name}'s differentiable "
                     f"keywords {allowed}.")
  if len(set(keys)) != len(keys):
    raise ValueError(f"keys must be distinct, got {keys}.")
  for key in keys:
    if key not in allowed:
      why = (NOT_DIFFERENTIABLE.get(name, {}).get(key) or _ROBUST.get(key)
             or "not a float keyword of its builder")
      raise ValueError(f"{key!r} of {name} is not differentiable ({why}); the "
                       f"differentiable keywords of {name} are {allowed}.")
  return keys


class Validation(NamedTuple):
  """The clients' held-out validation samples: inputs `(M, V, ...)`, labels and
  mask `(M, V)`."""
  x: np.ndarray
  y: np.ndarray
  mask: np.ndarray


def hold_out(federation: federation_lib.Federation, fraction: float, *, seed: int,
             batch_size: int = 1) -> tuple[federation_lib.Federation, Validation]:
  """Splits each client's training split into training and validation samples.

  Stratified as the train/test split is (`pflax.data.train_test_split`:
  `round(fraction n)` of each class of `n >= 2` samples, at least one left
  for training), seeded by `seed`. The test split is kept as it is and never
  used for validation.

  Args:
    federation: the clients' data (one run, `(M, L, ...)`).
    fraction: each class's share held out, in (0, 1).
    seed: seed of the draw.
    batch_size: the training data are padded to a multiple of it.

  Returns:
    `(training federation, validation)`: the federation keeps its test split,
    and its class counts and sample counts are the remaining training samples'.
  """
  if not 0.0 < fraction < 1.0:
    raise ValueError(f"validation_fraction must be in (0, 1), got {fraction}.")
  fed = federation
  mask = np.asarray(fed.mask)
  x = np.concatenate([np.asarray(fed.x)[i][mask[i]] for i in range(len(mask))])
  y = np.concatenate([np.asarray(fed.y)[i][mask[i]] for i in range(len(mask))])
  ends = np.cumsum(mask.sum(axis=1))
  indices = [np.arange(end - n, end) for end, n in zip(ends, mask.sum(axis=1))]
  k = np.asarray(fed.counts).shape[1]
  train, held = split_lib.train_test_split(
      partition_lib.make_partition(y, indices, k), y, test_fraction=fraction,
      seed=seed)
  tr = clients_lib.stack_clients(x, y, train.indices, pad_to_multiple=batch_size)
  va = clients_lib.stack_clients(x, y, held.indices)
  return (fed._replace(x=tr.x, y=tr.y, mask=tr.mask,
                       counts=np.asarray(train.counts, np.int32),
                       num_samples=tr.num_samples),
          Validation(va.x, va.y, va.mask))


@dataclasses.dataclass(frozen=True, eq=False)
class Task:
  """One algorithm on held-out data, ready for `validation_loss` (see `make_task`).

  Attributes:
    algorithm: the algorithm as `make_task` was given it (a name or a builder).
    name: the algorithm's name.
    builder: its builder.
    keys: the differentiated keywords, checked (`check_keys`).
    defaults: each key's value in the configuration (or the builder's default).
    config: the experiment (its `rounds` is `tune`'s default horizon).
    model: the Flax model.
    federation: the clients' training samples (validation held out) and test
      split, device arrays.
    validation: the held-out samples, device arrays.
    plan: the engine's plan (participation, faults, local training, strategy).
    chunk_size: clients per chunk of the "map" strategy.
    dtype: None, or the float dtype of the data and of the initial state
      (e.g. float64 under `jax.enable_x64`, to check hypergradients against
      finite differences).
  """
  algorithm: str | experiment.Builder
  name: str
  builder: experiment.Builder
  keys: tuple[str, ...]
  defaults: Mapping[str, float]
  config: experiment.ExperimentConfig
  model: nn.Module
  federation: federation_lib.Federation
  validation: Validation
  plan: engine.Plan
  chunk_size: int | None = None
  dtype: Any = None

  def groups(self, values: Mapping[str, chex.Numeric]) -> groups_lib.Groups:
    """The algorithm built with `values` (traced or not) for the keys it names."""
    _, optimizer, keywords = experiment.builder_arguments(self.algorithm, self.config)
    parts = self.plan.build.parts
    if parts is not None and experiment.takes_parts(self.builder):
      keywords.setdefault("parts", parts)
    for key, value in values.items():
      (optimizer if key == "lr" else keywords)[key] = value
    algorithm = self.builder(self.model, client_optimizer(**optimizer), **keywords)
    return groups_lib.as_groups(algorithm, self.model, self.plan.num_clients)


ADAM_EPS_ROOT = 1e-16
"""Adam's `eps_root` in the differentiable run: `sqrt(v)` has an infinite
derivative at 0, so without it one exactly-zero gradient coordinate (a dead
ReLU unit) makes the whole hypergradient NaN (optax's note on meta-gradients).
It changes no update measurably (the first moment is 0 there too)."""


def client_optimizer(optimizer: str = "sgd", lr: chex.Numeric = 0.05,
                     momentum: float = 0.0, adam_b1: float = 0.9,
                     grad_clip: float | None = None) -> optax.GradientTransformation:
  """`pflax.simulate.client_optimizer`, with Adam's `eps_root` set to
  `ADAM_EPS_ROOT` so that it can be differentiated through."""
  if optimizer != "adam":
    return experiment.client_optimizer(optimizer, lr, momentum, adam_b1, grad_clip)
  experiment.client_optimizer(optimizer, lr, momentum, adam_b1, grad_clip)  # its checks
  opt = optax.adam(lr, b1=adam_b1, b2=0.999, eps_root=ADAM_EPS_ROOT)
  if grad_clip:
    opt = optax.chain(optax.clip_by_global_norm(grad_clip), opt)
  return opt


def _default_value(algorithm: str | experiment.Builder,
                   config: experiment.ExperimentConfig, key: str) -> float:
  """A key's value in `config`, else the builder's default."""
  builder, optimizer, keywords = experiment.builder_arguments(algorithm, config)
  if key == "lr":
    return float(optimizer["lr"])
  if key in keywords:
    return float(keywords[key])
  return float(inspect.signature(builder).parameters[key].default)


def make_task(algorithm: str | experiment.Builder, config: experiment.ExperimentConfig,
              keys: Sequence[str], *, setup: experiment.Setup | None = None,
              data_seed: int = 0, validation_fraction: float = 0.2,
              split_seed: int = 0, chunk_size: int | None = None,
              dtype: Any = None, dataset: experiment.Data | None = None,
              model: nn.Module | None = None) -> Task:
  """Prepares a differentiable run of `algorithm` on held-out validation data.

  Args:
    algorithm: a name of `pflax.algorithms.METHODS`, `"module:builder"` or a
      builder.
    config: the experiment; its `strategy` must be "vmap" or "map" ("auto" is
      taken as "vmap"): the threaded "loop" runs clients outside JAX and
      cannot be traced.
    keys: the keywords to differentiate (`differentiable_keywords`).
    setup: a prepared federation (`pflax.simulate.prepare`); None: prepared
      from `config` (and `dataset`, `model`) with `data_seed`.
    data_seed: the partition's seed when `setup` is None.
    validation_fraction: each client's share (per class) of its training split
      held out for validation (`hold_out`).
    split_seed: the seed of the hold-out draw.
    chunk_size: clients per chunk of the "map" strategy (None: 1).
    dtype: None (the data's and the model's dtypes), or a float dtype for the
      data and the initial state (float64 needs `jax.enable_x64`).
    dataset, model: as in `pflax.simulate.prepare`.

  Raises:
    ValueError: for a non-differentiable key, the "loop" strategy,
      heterogeneous models, an algorithm with a warm-up phase, or whatever
      `pflax.simulate` refuses in `config`.
  """
  if config.strategy == "loop":
    raise ValueError("strategy 'loop' runs each client as its own jitted program from "
                     "a Python thread pool, which jax.grad cannot trace; use 'vmap' "
                     "or 'map' (memory-bounded chunks).")
  if config.heterogeneous:
    raise ValueError("heterogeneous=True is not supported by the differentiable run.")
  experiment.warn_participation(config)
  experiment.check_algorithm_keys(config, [algorithm])
  keys = check_keys(algorithm, keys)
  strategy = "vmap" if config.strategy == "auto" else config.strategy
  if setup is None:
    setup = experiment.prepare(config, data_seed, dataset=dataset, model=model)
  train, validation = hold_out(setup.federation, validation_fraction, seed=split_seed,
                               batch_size=config.batch_size)
  setup = dataclasses.replace(setup, federation=train)
  m = train.num_samples.shape[0]
  plan = experiment.plan(algorithm, config, setup, m, strategy, None)
  builder = (experiment.resolve_builder(algorithm) if isinstance(algorithm, str)
             else algorithm)
  name = experiment.algorithm_name(algorithm)
  if plan.build(None).algorithm.warmup is not None:
    raise ValueError(f"{name} has a warm-up phase, which the differentiable run does "
                     "not run: set its warmup_epochs=0 in config.hyperparameters.")
  defaults = {key: _default_value(algorithm, config, key) for key in keys}
  return Task(algorithm=algorithm, name=name, builder=builder, keys=keys,
              defaults=defaults, config=config, model=setup.model,
              federation=jax.device_put(engine.cast_floating(train, dtype)),
              validation=jax.device_put(engine.cast_floating(validation, dtype)),
              plan=plan, chunk_size=chunk_size, dtype=dtype)


class Outcome(NamedTuple):
  """What `validation_loss` returns.

  Attributes:
    losses: `(M,)` each client's mean cross-entropy on its validation samples
      with its personalized model (0 without validation samples).
    counts: `(M,)` validation samples per client.
    correct: `(M,)` correctly classified test samples (personalized models).
    train_losses: `(R, M)` mean local loss per round and client.
    carry: the engine's `Carry` after the rounds, a start for the next ones.
  """
  losses: chex.Array
  counts: chex.Array
  correct: chex.Array
  train_losses: chex.Array
  carry: engine.Carry

  @property
  def loss(self) -> chex.Array:
    """The sample-weighted mean validation loss (the scalar `tune` minimises)."""
    n = self.counts.astype(self.losses.dtype)
    return jnp.sum(n * self.losses) / jnp.maximum(jnp.sum(n), 1.0)


def _start(task: Task, groups: groups_lib.Groups, federation: Any,
           seed: chex.Array) -> engine.Carry:
  """The engine's `initial_carry`, the initial models in `task.dtype`."""
  counts = engine.declared_counts(task.plan, federation.counts, seed)
  return engine.initial_carry(groups, federation.x[0, :1], counts, seed, task.dtype)


def initial_carry(task: Task, values: Mapping[str, chex.Numeric] | None = None, *,
                  seed: int | chex.Array) -> engine.Carry:
  """The engine's state before round 1 for `seed` (initial model from
  `run_keys(seed)[0]`), built with `values` (default `task.defaults`)."""
  values = dict(task.defaults) if values is None else values
  return _start(task, task.groups(values), task.federation,
                jnp.asarray(seed, jnp.int32))


def _settled(one_round: Callable[..., tuple[engine.Carry, chex.Array]],
             carry: engine.Carry, t: chex.Array) -> engine.Carry:
  """`carry` in the dtypes a round gives it (e.g. cwFedAvg's initial class
  distributions, float32, become float64 with float64 models), so that the scan
  over rounds has one carry type."""
  for _ in range(3):
    out = jax.eval_shape(one_round, carry, t)[0]
    if all(a.dtype == b.dtype for a, b in zip(jax.tree.leaves(carry),
                                              jax.tree.leaves(out))):
      return carry
    carry = jax.tree.map(lambda a, b: a.astype(b.dtype), carry, out)
  return carry


def _trainer(task: Task, member: alg.Algorithm) -> Callable[..., train_lib.ClientResult]:
  """A group's client training (`engine.client_trainer`), each local step
  checkpointed (and each client, for "map", so only one chunk's steps are held
  at a time)."""
  one = engine.client_trainer(member, task.plan.local_epochs, task.plan.batch_size,
                              remat=True, precision=task.plan.precision)
  if task.plan.strategy == "map":
    one = jax.checkpoint(one)
  return mapping.map_clients(one, task.plan.strategy, task.chunk_size)


def _client_validation(model: nn.Module, params: Any, x: chex.Array, y: chex.Array,
                       mask: chex.Array) -> chex.Array:
  """One client's mean cross-entropy on its validation samples."""
  return losses_lib.cross_entropy(alg.logits(model, params, x), y, mask)


def _client_correct(model: nn.Module, params: Any, x: chex.Array, y: chex.Array,
                    mask: chex.Array) -> chex.Array:
  """One client's correctly classified test samples (no gradient)."""
  return train_lib.evaluate_client(functools.partial(alg.logits, model),
                                   jax.lax.stop_gradient(params), x, y, mask)


def _per_client(groups: groups_lib.Groups,
                per_client: Callable[..., chex.Array],
                held: tuple[Any, ...], *data: Any) -> chex.Array:
  """`(M,)`: `per_client(model, params, *rows)` of every client, mapped over
  each group (its model, its `held` models and its rows of each of `data`)."""
  return engine.in_client_order(groups, tuple(
      jax.vmap(functools.partial(per_client, model))(params, *rows)
      for model, params, *rows in zip(groups.models, held,
                                      *(groups.split(d) for d in data))))


@functools.partial(jax.jit, static_argnames=("task", "rounds"))
def _run(task: Task, values: Mapping[str, chex.Array], federation: Any,
         validation: Validation, seed: chex.Array, start: engine.Carry | None,
         first_round: chex.Array, *, rounds: int) -> Outcome:
  groups = task.groups(values)
  trainers = tuple(_trainer(task, member) for member in groups.members)
  feds = groups.split(federation)
  plan = task.plan
  if start is None:
    start = _start(task, groups, federation, seed)

  def train(clients):
    return tuple(trainer(*c) for trainer, c in zip(trainers, clients))

  @jax.checkpoint
  def one_round(carry, t):
    carry, metrics = engine.round_step(plan, groups, carry, feds, seed, t, train)
    return carry, metrics.losses

  ts = first_round + jnp.arange(rounds, dtype=jnp.int32)
  carry, train_losses = jax.lax.scan(one_round, _settled(one_round, start, ts[0]), ts)
  held = tuple(h["personalized"] for h in groups.algorithm.evaluate(carry.state))
  losses = _per_client(groups, _client_validation, held, validation.x, validation.y,
                       validation.mask)
  correct = _per_client(groups, _client_correct, held, federation.test_x,
                        federation.test_y, federation.test_mask)
  return Outcome(losses, jnp.sum(validation.mask, axis=1), correct, train_losses,
                 carry)


def validation_loss(task: Task, values: Mapping[str, chex.Numeric] | None = None, *,
                    seed: int | chex.Array, rounds: int,
                    start: engine.Carry | None = None,
                    first_round: int | chex.Array = 0) -> Outcome:
  """R rounds of the task's algorithm and the clients' validation losses, a pure
  function differentiable with respect to `values`.

  The rounds are the engine's (`pflax.simulate.sweep`'s programs give the same
  state for the same federation, seed and values): participants, shuffles,
  faults and server keys come from `seed` and the round number
  `first_round + r`. The builder is called inside the traced function with the
  (traced) values, each local step and each round are `jax.checkpoint`ed, and
  the rounds are a `lax.scan`, so reverse-mode memory grows with one round's
  local steps, not with R (measured in tests/test_tune.py):

  .. math::
    \\text{memory} \\approx R\\,|c| + M\\,E\\,S\\,(|\\theta| + |o|) + M\\,|a|

  for "vmap", with `|c|` the engine's carry (the algorithm's state and kept
  optimizer states), M clients, E local epochs of S steps, `|theta|` and
  `|o|` one client's parameters and optimizer state, and `|a|` one local
  step's activations and gradient temporaries (recomputed in the backward
  pass). With "map" in chunks of C clients each client's training is
  checkpointed too: `R |c| + M (|theta| + |o|) + C E S (|theta| + |o|) + C |a|`.
  Time: the rounds and each local step run forward again in the backward pass;
  a value and gradient took 4.5x a forward run (benchmarks/results/tune.md).

  Args:
    task: the prepared task (`make_task`).
    values: `{key: value}` for some of `task.keys` (traced or not); the others
      keep `task.defaults`. A key outside `task.keys` is refused.
    seed: the run's seed (int or traced int32).
    rounds: R (static: one compilation per R).
    start: the engine's carry to start from (`initial_carry`, or the `carry`
      of a previous `Outcome`); None: `initial_carry(task, values, seed=seed)`.
    first_round: the number of the first round (its keys), from 0.

  Returns:
    An `Outcome`; `Outcome.loss` is the scalar to differentiate.
  """
  values = dict(values or {})
  unknown = [k for k in values if k not in task.keys]
  if unknown:
    raise ValueError(f"values: {unknown[0]!r} is not a key of the task, which "
                     f"differentiates {task.keys}.")
  if rounds < 1:
    raise ValueError(f"rounds must be >= 1, got {rounds}.")
  full = {k: jnp.asarray(values.get(k, task.defaults[k])) for k in task.keys}
  return _run(task, full, task.federation, task.validation,
              jnp.asarray(seed, jnp.int32), start, jnp.asarray(first_round, jnp.int32),
              rounds=rounds)


# --- the tuner --------------------------------------------------------------------


def parametrization(key: str) -> str:
  """The built-in parametrization of a keyword: "logit" for `FRACTIONS`, else "log"."""
  return "logit" if key in FRACTIONS else "log"


def to_unconstrained(value: chex.Numeric, kind: str) -> chex.Array:
  """A value in its parametrization's unconstrained coordinates."""
  value = jnp.asarray(value)
  if kind == "log":
    return jnp.log(value)
  if kind == "logit":
    return jnp.log(value) - jnp.log1p(-value)
  return value


def from_unconstrained(u: chex.Numeric, kind: str) -> chex.Array:
  """Inverse of `to_unconstrained`."""
  if kind == "log":
    return jnp.exp(u)
  if kind == "logit":
    return jax.nn.sigmoid(u)
  return jnp.asarray(u)


def _check_start(key: str, value: float, kind: str) -> None:
  if kind not in PARAMETRIZATIONS:
    raise ValueError(f"parametrization of {key!r} must be one of {PARAMETRIZATIONS}, "
                     f"got {kind!r}.")
  ok = {"log": value > 0, "logit": 0 < value < 1, "identity": True}[kind]
  if not (ok and math.isfinite(value)):
    where = {"log": "> 0", "logit": "in (0, 1)"}[kind]
    raise ValueError(f"{key} starts at {value}, but its {kind} parametrization needs "
                     f"a value {where}.")


@dataclasses.dataclass(frozen=True)
class TuneStep:
  """One point of a tuning path.

  Attributes:
    step: the number of optimizer updates before this point (from 0).
    values: `{key: value}` evaluated.
    validation_loss: `Outcome.loss` at `values`.
    test_accuracy: personalized test accuracy (sample-weighted) after the rounds.
    gradient: `{key: d validation_loss / d value}` (in the key's own units).
    seed: the run's seed of this point.
    seconds: wall time of this point's gradient evaluation.
  """
  step: int
  values: Mapping[str, float]
  validation_loss: float
  test_accuracy: float
  gradient: Mapping[str, float]
  seed: int
  seconds: float

  def to_json(self) -> dict[str, Any]:
    return {**dataclasses.asdict(self), "values": dict(self.values),
            "gradient": dict(self.gradient)}

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> "TuneStep":
    return cls(int(d["step"]), dict(d["values"]), float(d["validation_loss"]),
               float(d["test_accuracy"]), dict(d["gradient"]), int(d["seed"]),
               float(d["seconds"]))


@dataclasses.dataclass(frozen=True)
class TuneRecord:
  """A tuning path, saved as JSON (`save`, `load`) and plotted (`plot`).

  Attributes:
    algorithm: the algorithm's name.
    keys: the tuned keywords.
    parametrizations: each key's parametrization (`PARAMETRIZATIONS`).
    rounds: rounds per evaluation.
    optimizer: a description of the optax optimizer.
    path: the points, one per step, the last after the last update.
    config: the experiment's configuration.
  """
  algorithm: str
  keys: tuple[str, ...]
  parametrizations: Mapping[str, str]
  rounds: int
  optimizer: str
  path: tuple[TuneStep, ...]
  config: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def best(self) -> TuneStep:
    """The point of lowest validation loss."""
    return min(self.path, key=lambda p: p.validation_loss)

  def to_json(self) -> dict[str, Any]:
    return {"algorithm": self.algorithm, "keys": list(self.keys),
            "parametrizations": dict(self.parametrizations), "rounds": self.rounds,
            "optimizer": self.optimizer, "config": _jsonable(self.config),
            "path": [p.to_json() for p in self.path]}

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> "TuneRecord":
    return cls(d["algorithm"], tuple(d["keys"]), dict(d["parametrizations"]),
               int(d["rounds"]), d["optimizer"],
               tuple(TuneStep.from_json(p) for p in d["path"]), d.get("config") or {})

  def save(self, path: str) -> None:
    """Writes the record as JSON to `path`, atomically (`records.write_json`)."""
    records.write_json(path, self.to_json())

  @classmethod
  def load(cls, path: str) -> "TuneRecord":
    with open(path, encoding="utf-8") as f:
      return cls.from_json(json.load(f))

  def plot(self, path: str | None = None) -> Any:
    """The path as a matplotlib figure (`plot_tuning`), written to `path` if given."""
    fig = plot_tuning(self)
    if path:
      plots.save_figure(fig, path, 120)
    return fig


def _jsonable(config: Any) -> Any:
  if dataclasses.is_dataclass(config):
    config = dataclasses.asdict(config)
  return json.loads(json.dumps(config, default=lambda o: repr(o)))


def plot_tuning(record: TuneRecord) -> Any:
  """A figure of a tuning path: each key's value (log scale for "log" and
  "logit" keys), the validation loss and the test accuracy against the step."""
  from pflax._src.simulation import plots  # pylint: disable=import-outside-toplevel
  panels = len(record.keys) + 2
  fig = plots.file_figure((3.2 * panels, 3.0))
  axes = fig.subplots(1, panels)
  steps = [p.step for p in record.path]
  for ax, key in zip(axes, record.keys):
    ax.plot(steps, [p.values[key] for p in record.path], marker="o", ms=3)
    if record.parametrizations.get(key) == "log":
      ax.set_yscale("log")
    ax.set(title=key, xlabel="step")
  axes[-2].plot(steps, [p.validation_loss for p in record.path], marker="o", ms=3)
  axes[-2].set(title="validation loss", xlabel="step")
  axes[-1].plot(steps, [100 * p.test_accuracy for p in record.path], marker="o", ms=3)
  axes[-1].set(title="test accuracy (%)", xlabel="step")
  fig.suptitle(f"{record.algorithm}: {record.rounds} rounds per step, {record.optimizer}")
  return fig


def tune(task: Task, *, steps: int, seed: int,
         optimizer: optax.GradientTransformation | None = None,
         optimizer_label: str | None = None, rounds: int | None = None,
         values: Mapping[str, float] | None = None,
         parametrizations: Mapping[str, str] | None = None,
         resample: bool = False,
         on_step: Callable[[TuneStep], None] | None = None) -> TuneRecord:
  """Gradient steps on the task's keys, minimising the validation loss.

  Each key is optimized in its unconstrained coordinates (`parametrization`:
  the log of a positive value, the logit of a fraction) by `optimizer`; each
  point runs `rounds` rounds from the initial model (`validation_loss`) and
  records the values, the validation loss, the test accuracy and the gradient.
  One compilation serves every point.

  Args:
    task: the prepared task (`make_task`).
    steps: optimizer updates; the path has `steps + 1` points (the last one's
      gradient is recorded, not applied).
    seed: the runs' seed (every random choice of the rounds derives from it).
    optimizer: an optax optimizer of the unconstrained values (None:
      `optax.adam(0.1)`, steps of about 10% of each value).
    optimizer_label: its description in the record (None: "adam(0.1)" for the
      default, else "optax").
    rounds: rounds per evaluation (None: `task.config.rounds`).
    values: the starting values (None: `task.defaults`).
    parametrizations: overrides of `parametrization(key)` by key.
    resample: if True, point k uses the seed `seed + k` (a stochastic
      hypergradient over initial models, participants and shuffles) instead of
      `seed` every time.
    on_step: called with each point as it is computed.

  Returns:
    The `TuneRecord`.
  """
  if steps < 0:
    raise ValueError(f"steps must be >= 0, got {steps}.")
  rounds = task.config.rounds if rounds is None else rounds
  label = optimizer_label or ("adam(0.1)" if optimizer is None else "optax")
  optimizer = optax.adam(0.1) if optimizer is None else optimizer
  start = {**task.defaults, **(values or {})}
  unknown = [k for k in start if k not in task.keys]
  if unknown:
    raise ValueError(f"values: {unknown[0]!r} is not a key of the task, which "
                     f"differentiates {task.keys}.")
  kinds = {k: (parametrizations or {}).get(k, parametrization(k)) for k in task.keys}
  for key in task.keys:
    _check_start(key, float(start[key]), kinds[key])
  dtype = jnp.result_type(float)
  unconstrained = {k: to_unconstrained(jnp.asarray(start[k], dtype), kinds[k])
                   for k in task.keys}
  constrain = lambda u: {k: from_unconstrained(u[k], kinds[k]) for k in task.keys}

  @jax.jit
  def point(u, seed_):
    def objective(v):
      out = validation_loss(task, v, seed=seed_, rounds=rounds)
      return out.loss, out.correct
    v, pullback = jax.vjp(constrain, u)
    (loss, correct), grads = jax.value_and_grad(objective, has_aux=True)(v)
    return v, loss, correct, grads, pullback(grads)[0]

  tests = float(np.sum(np.asarray(task.federation.test_mask)))
  opt_state = optimizer.init(unconstrained)
  path = []
  for k in range(steps + 1):
    run_seed = seed + k if resample else seed
    began = time.perf_counter()
    v, loss, correct, grads, du = jax.block_until_ready(
        point(unconstrained, np.int32(run_seed)))
    p = TuneStep(step=k, values={key: float(v[key]) for key in task.keys},
                 validation_loss=float(loss),
                 test_accuracy=float(np.sum(np.asarray(correct)) / tests),
                 gradient={key: float(grads[key]) for key in task.keys},
                 seed=run_seed, seconds=time.perf_counter() - began)
    path.append(p)
    if on_step:
      on_step(p)
    if k < steps:
      updates, opt_state = optimizer.update(du, opt_state, unconstrained)
      unconstrained = optax.apply_updates(unconstrained, updates)
  return TuneRecord(task.name, task.keys, kinds, rounds, label, tuple(path),
                    _jsonable(task.config))
