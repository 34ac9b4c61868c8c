"""Federated simulation: data preparation, the round loop, evaluation, checkpoints."""

import dataclasses
import functools
import os
import pickle
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from pflax import data
from pflax._src import algorithms as algos
from pflax._src import models
from pflax._src import train as train_lib
from pflax._src import tree as tree_lib

PARTITIONS = ("pathological", "dirichlet", "groups")
FINAL_WINDOW = 5


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """Everything that defines an experiment, as plain values."""
  dataset: str = "digits"
  data_dir: str | None = None
  partition: str = "pathological"
  clients: int = 20
  classes_per_client: int = 2
  dirichlet_alpha: float = 0.1
  iid_fraction: float = 0.2
  participation: float = 1.0
  rounds: int = 40
  eval_every: int = 1
  model: str = "auto"
  heterogeneous: bool = False
  strategy: str = "auto"
  hp: algos.Hyperparameters = algos.Hyperparameters()


@dataclasses.dataclass(frozen=True)
class Setup:
  """A prepared federation with its model."""
  federation: algos.Federation
  model: Any
  input_shape: tuple[int, ...]
  num_classes: int


def _partition(config: ExperimentConfig, labels: np.ndarray, num_classes: int,
               seed: int) -> data.Partition:
  if config.partition == "pathological":
    return data.pathological(labels, config.clients, config.classes_per_client,
                             num_classes=num_classes, seed=seed)
  if config.partition == "dirichlet":
    return data.dirichlet(labels, config.clients, config.dirichlet_alpha,
                          num_classes=num_classes, seed=seed,
                          min_partition_size=min(10, len(labels) // config.clients))
  if config.partition == "groups":
    return data.groups(labels, config.clients, iid_fraction=config.iid_fraction,
                       seed=seed)
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
  """Loads the dataset, partitions it over clients (75/25 split) and stacks it."""
  dataset = data.load(config.dataset, data_dir=config.data_dir)
  partition = _partition(config, dataset.labels, dataset.num_classes, seed)
  train, test = data.train_test_split(partition, dataset.labels, seed=seed)
  tr = data.stack_clients(dataset.images, dataset.labels, train.indices,
                          pad_to_multiple=config.hp.batch_size)
  te = data.stack_clients(dataset.images, dataset.labels, test.indices)
  federation = algos.Federation(
      x=jnp.asarray(tr.x), y=jnp.asarray(tr.y), valid=jnp.asarray(tr.mask),
      test_x=jnp.asarray(te.x), test_y=jnp.asarray(te.y),
      test_valid=jnp.asarray(te.mask), counts=jnp.asarray(train.counts),
      num_samples=jnp.asarray(tr.num_samples))
  input_shape = tuple(dataset.images.shape[1:])
  model = models.get_model(_model_name(config.model, input_shape), dataset.num_classes,
                           input_shape)
  return Setup(federation, model, input_shape, dataset.num_classes)


def participants(key: chex.PRNGKey, num_clients: int, participation: float) -> chex.Array:
  """A fixed number `max(1, round(participation * M))` of clients, sorted."""
  count = max(1, int(round(participation * num_clients)))
  return jnp.sort(jax.random.permutation(key, num_clients)[:count])


def output_norms(params: Any) -> chex.Array:
  """`(M, K)` l2-norms of each client's output-layer weight vectors (Fig. 3)."""
  kernel = params["classifier"]["output"]["kernel"]
  return jnp.sqrt(jnp.sum(jnp.square(kernel.astype(jnp.float32)), axis=-2))


def run_keys(seed: int | chex.Array) -> chex.Array:
  """The keys `(init, warm-up, rounds)` of a run, all derived from its seed."""
  return jax.random.split(jax.random.PRNGKey(seed), 3)


def round_keys(round_key: chex.PRNGKey, t: int | chex.Array) -> chex.Array:
  """The keys `(participants, training, server)` of round `t`."""
  return jax.random.split(jax.random.fold_in(round_key, t), 3)


def healthy(took_part: chex.Array, trained: Any) -> chex.Array:
  """Mask of the clients that took part and uploaded finite values."""
  return took_part & tree_lib.finite_clients(trained)


def chosen_mask(num_clients: int, chosen: chex.Array) -> chex.Array:
  """Boolean `(M,)` mask of the chosen client indices."""
  return jnp.zeros(num_clients, bool).at[chosen].set(True)


def round_record(t: int, losses: np.ndarray, took_part: np.ndarray,
                 healthy: np.ndarray, order: np.ndarray) -> dict[str, Any]:
  """A round's record: mean loss over healthy clients, dropped clients' indices.

  `order[i]` is the client index of position i of the per-client arrays.
  """
  return {"round": t + 1,
          "train_loss": float(np.sum(losses[healthy]) / max(healthy.sum(), 1)),
          "dropped_clients": sorted(int(order[i]) for i in
                                    np.flatnonzero(took_part & ~healthy))}


class _Programs(NamedTuple):
  """The compiled pieces of one algorithm on one architecture (data-free)."""
  algorithm: algos.Algorithm
  trainer: Callable[..., Any]
  warmup: Callable[..., Any] | None
  init_opt_state: Callable[..., Any]
  inputs: Callable[..., Any]
  outputs: Callable[..., Any]
  evaluate: Callable[..., Any]
  correct: Callable[..., Any]


@functools.lru_cache(maxsize=64)
def _programs(name: str, model: Any, hp: algos.Hyperparameters, strategy: str,
              input_shape: tuple[int, ...]) -> _Programs:
  """Builds (once per process and configuration) an algorithm's jitted steps.

  The data are arguments, never constants, so runs with other seeds or partitions
  of the same shapes reuse the compiled programs.
  """
  algorithm = algos.get_algorithm(name, model, hp, input_shape)
  trainer = functools.partial(train_lib.make_trainer, algorithm.loss,
                              algorithm.optimizer, batch_size=hp.batch_size,
                              strategy=strategy, unroll=algorithm.unroll)
  warm = name == "fedclassavg" and hp.fedclassavg_warmup_epochs
  apply = lambda p, x: model.apply({"params": p}, x)
  return _Programs(
      algorithm=algorithm,
      trainer=trainer(epochs=hp.local_epochs),
      warmup=trainer(epochs=hp.fedclassavg_warmup_epochs) if warm else None,
      init_opt_state=jax.jit(functools.partial(algos.init_opt_state, algorithm)),
      inputs=jax.jit(functools.partial(algos.client_inputs, algorithm)),
      outputs=jax.jit(functools.partial(algos.client_outputs, algorithm)),
      evaluate=jax.jit(algorithm.evaluate),
      correct=train_lib.map_clients(
          functools.partial(train_lib.evaluate_client, apply), strategy))


class _Group:
  """Clients sharing one architecture: their data and the compiled programs."""

  def __init__(self, name: str, model: Any, index: np.ndarray, setup: Setup,
               config: ExperimentConfig):
    self.index = index
    self.model = model
    self.fed = jax.tree.map(lambda a: a[index], setup.federation)
    self.programs = _programs(name, model, config.hp,
                              train_lib.resolve_strategy(config.strategy),
                              setup.input_shape)
    self.algorithm = self.programs.algorithm

  def init(self, key: chex.PRNGKey) -> tuple[Any, Any]:
    """Initial state (all clients from one model) and optimizer state."""
    m = len(self.index)
    params = models.init_stacked(self.model, key, self.fed.x[0, :1], m, same_init=True)
    state = self.algorithm.init(params, self.fed, key)
    return state, self.programs.init_opt_state(state)

  def train(self, trainer: Any, state: Any, opt_state: Any, chosen: chex.Array,
            key: chex.PRNGKey) -> tuple[Any, Any, chex.Array]:
    """Local training of the chosen clients: `(trained, opt_state, losses)`."""
    p = self.programs
    result = trainer(*p.inputs(state, opt_state, self.fed, chosen, key))
    return p.outputs(state, opt_state, chosen, result)

  def evaluate(self, state: Any) -> tuple[Any, Any]:
    """`(personalized, global or None)` stacked models of the group's clients."""
    return self.programs.evaluate(state)

  def correct(self, stacked: Any) -> int:
    """Correctly classified test samples over the group's clients."""
    fed = self.fed
    return int(jnp.sum(self.programs.correct(stacked, fed.test_x, fed.test_y,
                                             fed.test_valid)))


def _groups(name: str, config: ExperimentConfig, setup: Setup) -> list[_Group]:
  """One group of all clients, or FedClassAvg's architecture groups (round robin)."""
  m = int(setup.federation.num_samples.shape[0])
  if not config.heterogeneous:
    return [_Group(name, setup.model, np.arange(m), setup, config)]
  if name != "fedclassavg":
    raise ValueError("heterogeneous models are supported by 'fedclassavg' only, "
                     f"got {name!r}.")
  family = models.heterogeneous_family(setup.num_classes)
  return [_Group(name, model, np.arange(g, m, len(family)), setup, config)
          for g, model in enumerate(family) if g < m]


@functools.lru_cache(maxsize=64)
def _server_step(algorithm: algos.Algorithm, num_groups: int) -> Callable[..., Any]:
  """Jitted server step over all groups: health mask, then aggregation."""

  def step(states, trained, chosen, key):
    took_part = [chosen_mask(tree_lib.num_clients(x), c) for x, c in zip(trained, chosen)]
    health = [healthy(t, x) for t, x in zip(took_part, trained)]
    if num_groups == 1:
      states = [algorithm.server_update(states[0], trained[0], health[0], key)]
    else:
      states = algos.fedclassavg_joint_update(states, trained, health)
    return states, jnp.concatenate(took_part), jnp.concatenate(health)

  return jax.jit(step)


def _summary(values: list[float]) -> dict[str, float]:
  return {"best": float(max(values)), "final": float(np.mean(values[-FINAL_WINDOW:]))}


def _checkpoint_path(directory: str, algorithm: str, seed: int) -> str:
  return os.path.join(directory, f"{algorithm}-seed{seed}.pkl")


def _save(path: str, payload: dict[str, Any]) -> None:
  payload = {**payload, "state": jax.tree.map(np.asarray, payload["state"]),
             "opt_state": jax.tree.map(np.asarray, payload["opt_state"])}
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    pickle.dump(payload, f)
  os.replace(tmp, path)


def run(algorithm: str, config: ExperimentConfig, seed: int, *,
        setup: Setup | None = None,
        on_round: Callable[[dict[str, Any]], None] | None = None,
        checkpoint_dir: str | None = None, checkpoint_every: int = 0,
        resume: bool = False) -> dict[str, Any]:
  """Runs one algorithm for `config.rounds` rounds with one seed.

  Every random choice derives from `seed`: the partition, the initial model, and
  per round (via `fold_in(key, round)`) the participants, the local shuffles and
  the server's randomness, so a resumed run equals an uninterrupted one.

  Returns:
    The run record of `results.json` (SPEC §5) plus `output_norms`.
  """
  setup = setup or prepare(config, seed)
  groups = _groups(algorithm, config, setup)
  order = np.concatenate([g.index for g in groups])
  server = _server_step(groups[0].algorithm, len(groups))
  total = int(jnp.sum(setup.federation.test_valid))
  evaluate = lambda models_: sum(g.correct(x) for g, x in zip(groups, models_)) / total
  init_key, warm_key, round_key = run_keys(seed)

  history, first = [], 0
  path = checkpoint_dir and _checkpoint_path(checkpoint_dir, algorithm, seed)
  if resume and path and os.path.exists(path):
    with open(path, "rb") as f:
      saved = pickle.load(f)
    states, opt_states = saved["state"], saved["opt_state"]
    history, first = saved["history"], saved["round"]
  else:
    states, opt_states = map(list, zip(*[g.init(init_key) for g in groups]))
    for i, g in enumerate(groups):
      if g.programs.warmup is not None:
        everyone = jnp.arange(len(g.index))
        trained, _, _ = g.train(g.programs.warmup, states[i], opt_states[i], everyone, warm_key)
        states[i] = {**states[i], "params": trained}

  started = time.perf_counter()
  for t in range(first, config.rounds):
    sample_key, train_key, server_key = round_keys(round_key, t)
    chosen = [participants(jax.random.fold_in(sample_key, i), len(g.index),
                           config.participation) for i, g in enumerate(groups)]
    outs = [g.train(g.programs.trainer, states[i], opt_states[i], chosen[i],
                    jax.random.fold_in(train_key, i)) for i, g in enumerate(groups)]
    trained, opt_states, losses = (list(x) for x in zip(*outs))
    states, took_part, healthy = server(states, trained, chosen, server_key)
    took_part, healthy = np.asarray(took_part), np.asarray(healthy)
    losses = np.concatenate([np.asarray(x) for x in losses])
    record = round_record(t, losses, took_part, healthy, order)
    if (t + 1) % config.eval_every == 0 or t + 1 == config.rounds:
      personal, global_ = zip(*[g.evaluate(s) for g, s in zip(groups, states)])
      record["personalized_accuracy"] = evaluate(personal)
      if global_[0] is not None:
        record["global_accuracy"] = evaluate(global_)
    history.append(record)
    if on_round:
      on_round(record)
    if path and checkpoint_every and (t + 1) % checkpoint_every == 0:
      _save(path, {"state": states, "opt_state": opt_states, "history": history,
                   "round": t + 1})

  norms = np.zeros(setup.federation.counts.shape, np.float32)
  for g, s in zip(groups, states):
    norms[g.index] = np.asarray(output_norms(g.evaluate(s)[0]))
  return run_record(algorithm, seed, history, norms, time.perf_counter() - started)


def run_record(algorithm: str, seed: int, history: list[dict[str, Any]],
               norms: np.ndarray, seconds: float) -> dict[str, Any]:
  """The record of one run in `results.json` (SPEC §5), plus `output_norms`."""
  evaluated = [h for h in history if "personalized_accuracy" in h]
  global_values = [h["global_accuracy"] for h in evaluated if "global_accuracy" in h]
  return {
      "algorithm": algorithm,
      "seed": seed,
      "personalized_accuracy": _summary([h["personalized_accuracy"] for h in evaluated]),
      "global_accuracy": _summary(global_values) if global_values else None,
      "history": history,
      "seconds": seconds,
      "output_norms": np.asarray(norms).tolist(),
  }
