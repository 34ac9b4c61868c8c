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
  faulty_clients: float = 0.0
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


def group_participants(key: chex.PRNGKey, groups: list[np.ndarray],
                       participation: float) -> list[np.ndarray]:
  """A round's participants drawn over all clients, then split by group.

  `participants(key, M, participation)` picks `max(1, round(p M))` of all
  `M = sum_g len(groups[g])` clients, as in the paper's Algorithm 1; group g
  (client indices `groups[g]`) trains the sorted positions of its chosen
  clients, possibly none.
  """
  chosen = np.asarray(participants(key, sum(len(g) for g in groups), participation))
  return [np.flatnonzero(np.isin(g, chosen)) for g in groups]


def accuracies(kind: str, correct: np.ndarray, tests: np.ndarray) -> dict[str, float]:
  """A round's accuracies of one kind of model (`pflax.algorithms.EVALUATED`).

  `<kind>_accuracy` is sample-weighted (all correct test samples over all test
  samples); `<kind>_client_mean` and `<kind>_client_std` are the unweighted
  mean and the standard deviation (ddof 0) over clients of each client's own
  accuracy, as the FedClassAvg paper reports them (mean ± std). Clients without
  test samples have no accuracy and are left out of the mean and std.

  Args:
    kind: the kind of model, e.g. "personalized".
    correct: `(M,)` correctly classified test samples per client.
    tests: `(M,)` test samples per client.
  """
  own = correct[tests > 0] / tests[tests > 0]
  return {f"{kind}_accuracy": float(np.sum(correct) / np.sum(tests)),
          f"{kind}_client_mean": float(np.mean(own)),
          f"{kind}_client_std": float(np.std(own))}


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


FAULT_STREAM = 0xFA17
"""`fold_in(participants_key, FAULT_STREAM)` draws a round's faulty clients."""


def check_faults(fraction: float, name: str = "faulty_clients") -> None:
  """Raises unless `fraction` (`ExperimentConfig.faulty_clients`) is in [0, 1)."""
  if not 0.0 <= fraction < 1.0:
    raise ValueError(f"{name} must be a fraction in [0, 1), got {fraction}.")


def num_faulty(fraction: float, participants: int) -> int:
  """`round(fraction * P)`: how many of a round's `P` participants are faulty."""
  return int(round(fraction * participants))


def faulty_clients(key: chex.PRNGKey, took_part: chex.Array, count: int,
                   ids: chex.Array | None = None) -> chex.Array:
  """Bool `(M,)`: `count` of the clients that took part (`num_faulty`).

  Client `ids[i]` (default `i`) gets the score `uniform(fold_in(key, ids[i]))`
  and the participants with the lowest scores are faulty, so the draw does not
  depend on padding or on how clients are grouped.
  """
  ids = jnp.arange(took_part.shape[0]) if ids is None else ids
  score = jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(key, i)))(ids)
  score = jnp.where(took_part, score, 2.0)
  rank = jnp.argsort(jnp.argsort(score))
  return took_part & (rank < count)


def upload_faults(trained: Any, faulty: chex.Array) -> Any:
  """The uploads with every entry of the faulty clients set to NaN."""
  def corrupt(x):
    return jnp.where(faulty.reshape((-1,) + (1,) * (x.ndim - 1)),
                     jnp.asarray(jnp.nan, x.dtype), x)
  return jax.tree.map(corrupt, trained)


def chosen_mask(num_clients: int, chosen: chex.Array) -> chex.Array:
  """Boolean `(M,)` mask of the chosen client indices."""
  return jnp.zeros(num_clients, bool).at[chosen].set(True)


def round_record(t: int, losses: np.ndarray, took_part: np.ndarray,
                 healthy: np.ndarray, faulty: np.ndarray,
                 order: np.ndarray) -> dict[str, Any]:
  """A round's record: mean loss over healthy clients, dropped and faulty clients.

  `dropped_clients` took part but were not aggregated (non-finite uploads, the
  injected faults among them); `faulty_clients` are the injected faults
  (`ExperimentConfig.faulty_clients`). `order[i]` is the client index of
  position i of the per-client arrays.
  """
  indices = lambda flags: sorted(int(order[i]) for i in np.flatnonzero(flags))
  return {"round": t + 1,
          "train_loss": float(np.sum(losses[healthy]) / max(healthy.sum(), 1)),
          "dropped_clients": indices(took_part & ~healthy),
          "faulty_clients": indices(faulty)}


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
    if len(chosen) == 0:
      return self.algorithm.start(state), opt_state, jnp.zeros(len(self.index))
    result = trainer(*p.inputs(state, opt_state, self.fed, chosen, key))
    return p.outputs(state, opt_state, chosen, result)

  def evaluate(self, state: Any) -> dict[str, Any]:
    """`{kind: stacked}` models of the group's clients to test (`Algorithm.evaluate`)."""
    return self.programs.evaluate(state)

  def correct(self, stacked: Any) -> np.ndarray:
    """`(m,)` correctly classified test samples of each of the group's clients."""
    fed = self.fed
    return np.asarray(self.programs.correct(stacked, fed.test_x, fed.test_y,
                                            fed.test_valid))


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
def _server_step(algorithm: algos.Algorithm, num_groups: int,
                 fault_fraction: float) -> Callable[..., Any]:
  """Jitted server step over all groups: faults, health mask, then aggregation.

  `step(states, trained, opt_before, opt_after, chosen, ids, key, fault_key)`
  returns `(states, opt_states, took_part, healthy, faulty)`; unhealthy
  clients are treated as absent (`pflax.algorithms.drop_unhealthy`) and a
  round without any healthy client keeps the states.
  """

  def step(states, trained, opt_before, opt_after, chosen, ids, key, fault_key):
    took_part = [chosen_mask(tree_lib.num_clients(x), c) for x, c in zip(trained, chosen)]
    sizes = np.cumsum([t.shape[0] for t in took_part])[:-1]
    every = jnp.concatenate(took_part)
    count = num_faulty(fault_fraction, sum(c.shape[0] for c in chosen))
    faulty = (faulty_clients(fault_key, every, count, jnp.concatenate(ids))
              if count else jnp.zeros_like(every))
    trained = [upload_faults(x, f) for x, f in zip(trained, jnp.split(faulty, sizes))]
    health = [healthy(t, x) for t, x in zip(took_part, trained)]
    kept = [algos.drop_unhealthy(algorithm, *args)
            for args in zip(states, trained, opt_before, opt_after, health)]
    trained, opt_states = (list(x) for x in zip(*kept))
    if num_groups == 1:
      new = [algorithm.server_update(states[0], trained[0], health[0], key)]
    else:
      new = algos.fedclassavg_joint_update(states, trained, health)
    every_health = jnp.concatenate(health)
    return (algos.keep_if_nobody(every_health, new, states), opt_states, every,
            every_health, faulty)

  return jax.jit(step)


def _summary(kind: str, history: list[dict[str, Any]]) -> dict[str, float] | None:
  """`best` and `final` (mean of the last `FINAL_WINDOW` evaluations) of
  `<kind>_accuracy`, with `client_mean` and `client_std` averaged over the same
  final window; None if the kind was never evaluated."""
  evaluated = [h for h in history if f"{kind}_accuracy" in h]
  if not evaluated:
    return None
  values = [h[f"{kind}_accuracy"] for h in evaluated]
  final = evaluated[-FINAL_WINDOW:]
  return {"best": float(max(values)), "final": float(np.mean(values[-FINAL_WINDOW:])),
          "client_mean": float(np.mean([h[f"{kind}_client_mean"] for h in final])),
          "client_std": float(np.mean([h[f"{kind}_client_std"] for h in final]))}


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
  per round (via `fold_in(key, round)`) the participants, the local shuffles,
  the server's randomness and the faulty clients (`config.faulty_clients`, a
  stream of their own), so a resumed run equals an uninterrupted one.

  Returns:
    The run record of `results.json` (SPEC §5) plus `output_norms`.
  """
  check_faults(config.faulty_clients)
  setup = setup or prepare(config, seed)
  groups = _groups(algorithm, config, setup)
  order = np.concatenate([g.index for g in groups])
  server = _server_step(groups[0].algorithm, len(groups), config.faulty_clients)
  tests = np.asarray(jnp.sum(setup.federation.test_valid, axis=1))[order]

  def evaluate(states):
    held = [g.evaluate(s) for g, s in zip(groups, states)]
    out = {}
    for kind in (k for k in algos.EVALUATED if k in held[0]):
      correct = np.concatenate([g.correct(h[kind]) for g, h in zip(groups, held)])
      out.update(accuracies(kind, correct, tests))
    return out

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
        trained, _ = algos.drop_unhealthy(g.algorithm, states[i], trained, opt_states[i],
                                          opt_states[i], tree_lib.finite_clients(trained))
        states[i] = {**states[i], "params": trained}

  started = time.perf_counter()
  for t in range(first, config.rounds):
    sample_key, train_key, server_key = round_keys(round_key, t)
    chosen = group_participants(jax.random.fold_in(sample_key, 0),
                                [g.index for g in groups], config.participation)
    outs = [g.train(g.programs.trainer, states[i], opt_states[i], chosen[i],
                    jax.random.fold_in(train_key, i)) for i, g in enumerate(groups)]
    trained, trained_opt, losses = (list(x) for x in zip(*outs))
    states, opt_states, took_part, healthy, faulty = server(
        states, trained, opt_states, trained_opt, chosen, [g.index for g in groups],
        server_key, jax.random.fold_in(sample_key, FAULT_STREAM))
    took_part, healthy, faulty = (np.asarray(x) for x in (took_part, healthy, faulty))
    losses = np.concatenate([np.asarray(x) for x in losses])
    record = round_record(t, losses, took_part, healthy, faulty, order)
    if (t + 1) % config.eval_every == 0 or t + 1 == config.rounds:
      record.update(evaluate(states))
    history.append(record)
    if on_round:
      on_round(record)
    if path and checkpoint_every and (t + 1) % checkpoint_every == 0:
      _save(path, {"state": states, "opt_state": opt_states, "history": history,
                   "round": t + 1})

  norms = np.zeros(setup.federation.counts.shape, np.float32)
  for g, s in zip(groups, states):
    norms[g.index] = np.asarray(output_norms(g.evaluate(s)["personalized"]))
  return run_record(algorithm, seed, history, norms, time.perf_counter() - started)


def run_record(algorithm: str, seed: int, history: list[dict[str, Any]],
               norms: np.ndarray, seconds: float) -> dict[str, Any]:
  """The record of one run in `results.json` (SPEC §5), plus `output_norms`.

  Every kind of `pflax.algorithms.EVALUATED` has its `<kind>_accuracy` summary
  (`_summary`), None where the algorithm has no such model.
  """
  return {
      "algorithm": algorithm,
      "seed": seed,
      **{f"{kind}_accuracy": _summary(kind, history) for kind in algos.EVALUATED},
      "faulty_uploads": sum(len(h["faulty_clients"]) for h in history),
      "history": history,
      "seconds": seconds,
      "output_norms": np.asarray(norms).tolist(),
  }
