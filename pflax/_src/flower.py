"""pflax's algorithms in a real federation: a Flower strategy and client app.

The server runs `PflaxStrategy`, a Flower strategy (message API) whose server
step is the algorithm's own `server_update` on the stacked uploads of the
round; it keeps the algorithm's state (class models, FedReMa's history map,
...) between rounds and sends each client its own model. A client runs
`client_app()`: pflax's local training with the algorithm's loss (the WDR,
the proximal terms, SupCon, FedDWA's pair of models). Messages:

1. `query` (once): the server sends the experiment (`ExperimentConfig` as JSON,
   algorithm, seed); each client answers with its client id (`node_config
   ["partition-id"]`), training class counts, input shape and test size.
2. `train` (every round, to the round's participants): the client's starting
   model and loss context, and its key, epochs and batch size; the reply holds
   the trained model and the mean loss. FedClassAvg's warm-up is a `train`
   round 0 of every client.
3. `evaluate` (every `eval_every` rounds, to every client): the models to test
   by kind (`pflax.algorithms.EVALUATED`); the reply holds correct counts.

Every key is drawn as the engine draws it (`pflax._src.protocol`), so a
federation reproduces `pflax.simulate.run` with the same experiment and seed.
Arrays travel as NumPy's `.npy` bytes (Flower's `Array`), which load without
pickle, each distinct array of a message once (`pack`): a loss context equal
to the model (FedProx's anchor), or an evaluated kind equal to another
(FedAvg's global and personalized models), costs no bytes. The optimizer state
a client keeps between rounds (FedReMa's momentum) stays in its `Context`.
What the server computes from the uploads (class counts from the output
layer, FedReMa's soft logits on its probe, FedDWA's similarities) needs no
extra message: the class counts of cwFedAvg travel once, at registration.
"""

import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np

# pflax's federations reach only the addresses their user gives: Flower's
# telemetry and update check stay off unless the user sets these variables.
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

try:
  import flwr
  from flwr import app as flwr_app
  from flwr import clientapp as flwr_clientapp
  from flwr import serverapp as flwr_serverapp
  from flwr.serverapp import strategy as flwr_strategy
except ImportError as e:  # pragma: no cover - exercised without the extra
  raise ImportError("pflax.flower needs Flower: pip install 'pflax[flower]'") from e

from pflax._src import algorithm as alg
from pflax._src import engine
from pflax._src import protocol
from pflax._src import records
from pflax._src import simulate

LOG = logging.getLogger("pflax.flower")
QUERY, TRAIN, EVALUATE = "query", "train", "evaluate"


# --- trees as Flower records ------------------------------------------------

def to_record(tree: Any) -> "flwr_app.ArrayRecord":
  """A pytree as an ArrayRecord, one `Array` per leaf named by its key path."""
  return flwr_app.ArrayRecord({jax.tree_util.keystr(path): flwr_app.Array(
      np.asarray(leaf)) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)})


def from_record(record: "flwr_app.ArrayRecord", like: Any, name: str = "record") -> Any:
  """The pytree of `like`'s structure, shapes and dtypes stored in `record`.

  Raises:
    ValueError: naming `name` and the first key missing, unexpected, or of
      another shape or dtype than `like`'s.
  """
  paths = jax.tree_util.tree_leaves_with_path(like)
  expected = {jax.tree_util.keystr(path): leaf for path, leaf in paths}
  extra = sorted(set(record) - set(expected))
  missing = sorted(set(expected) - set(record))
  if extra or missing:
    raise ValueError(f"{name}: keys {missing} missing and {extra} unexpected.")
  leaves = []
  for key, leaf in expected.items():
    value = record[key].numpy()
    if value.shape != np.shape(leaf) or value.dtype != np.dtype(leaf.dtype):
      raise ValueError(f"{name}[{key}] must be {np.dtype(leaf.dtype)}"
                       f"{tuple(np.shape(leaf))}, got {value.dtype}{value.shape}.")
    leaves.append(value)
  return jax.tree.unflatten(jax.tree.structure(like), leaves)


def pack(tree: Any) -> tuple["flwr_app.ArrayRecord", "flwr_app.ConfigRecord"]:
  """`tree` as `(arrays, same)` records: its leaves as `to_record` names them,
  each distinct array once; `same` maps every other leaf's key to the key of the
  identical array (same dtype, shape and bytes) that is sent in its place
  (FedProx's anchor is the model it starts from: one copy travels, not two)."""
  record = to_record(tree)
  arrays, same, kept = flwr_app.ArrayRecord(), {}, []
  for key in list(record.keys()):
    array = record[key]
    twin = next((k for k, a in kept if (a.dtype, a.shape, a.data)
                 == (array.dtype, array.shape, array.data)), None)
    if twin is None:
      arrays[key] = array
      kept.append((key, array))
    else:
      same[key] = twin
  return arrays, flwr_app.ConfigRecord(same)


def unpack(arrays: "flwr_app.ArrayRecord", same: "flwr_app.ConfigRecord", like: Any,
           name: str = "record") -> Any:
  """The tree `pack` made `(arrays, same)` of, checked against `like` as
  `from_record` checks it."""
  full = {key: arrays[key] for key in arrays.keys()}
  for key, twin in same.items():
    if twin not in full:
      raise ValueError(f"{name}: {key} refers to {twin}, which was not sent.")
    full[key] = full[twin]
  return from_record(flwr_app.ArrayRecord(full), like, name)


def _packed(tree: Any, config: "flwr_app.ConfigRecord | flwr_app.MetricRecord",
            name: str = "config") -> "flwr_app.RecordDict":
  """A message's content: `tree` packed (`arrays`, `same`) and `config` (or a
  reply's metrics) under `name`."""
  arrays, same = pack(tree)
  return flwr_app.RecordDict({"arrays": arrays, "same": same, name: config})


def _unpacked(content: "flwr_app.RecordDict", like: Any, name: str) -> Any:
  return unpack(content["arrays"], content["same"], like, name)


def _row(stacked: Any, i: int) -> Any:
  return jax.tree.map(lambda x: np.asarray(x[i]), stacked)


# --- the experiment, as the server and the clients build it --------------------

@dataclasses.dataclass(frozen=True)
class Experiment:
  """What a federation runs: an algorithm (a name of `pflax.algorithms.BUILDERS`
  or `"module:builder"`), its `ExperimentConfig` and the seed."""
  algorithm: str
  config: simulate.ExperimentConfig
  seed: int = 0

  def to_json(self) -> str:
    return json.dumps({"algorithm": self.algorithm, "seed": self.seed,
                       "config": dataclasses.asdict(self.config)}, sort_keys=True)

  @classmethod
  def from_json(cls, text: str) -> "Experiment":
    d = json.loads(text)
    return cls(d["algorithm"], simulate.ExperimentConfig(**d["config"]), int(d["seed"]))

  def check(self) -> None:
    """Raises ValueError for what a federation does not run."""
    simulate.check_config(self.config)
    simulate.check_algorithm(self.algorithm, self.config)
    if self.config.heterogeneous:
      raise ValueError("heterogeneous=True is simulated only: a Flower client trains "
                       "one architecture.")
    if self.config.faulty_clients:
      raise ValueError("faulty_clients is a simulation of faults: 0 in a federation, "
                       f"got {self.config.faulty_clients}.")

  def build(self, input_shape: tuple[int, ...], num_classes: int
            ) -> tuple[alg.Algorithm, Any]:
    """`(algorithm, model)` as `pflax.simulate` builds them."""
    return simulate.build_algorithm(self.algorithm, self.config, input_shape,
                                    num_classes)


# --- the server ------------------------------------------------------------

class PflaxStrategy(flwr_strategy.Strategy):
  """A Flower strategy running one pflax algorithm (see the module docstring).

  Args:
    experiment: the algorithm, configuration and seed; the clients receive it.
    on_round: called with each `RoundRecord` once its round is evaluated (or
      not due for evaluation).

  After `start`, `results()` holds the run as `pflax.simulate.Results` (its
  `seconds` since `start` began), and `bytes_per_round` the bytes of arrays
  sent and received per round.
  """

  def __init__(self, experiment: Experiment,
               on_round: Callable[[records.RoundRecord], None] | None = None):
    experiment.check()
    self.experiment = experiment
    self.on_round = on_round
    self.nodes: dict[int, int] = {}          # client -> node id
    self.history: list[records.RoundRecord] = []
    self.bytes_per_round: list[dict[str, int]] = []
    self._started: float | None = None
    self._algorithm: alg.Algorithm | None = None
    self._state: Any = None
    self._tasks: protocol.Tasks | None = None

  # The clients and the initial state.

  @property
  def num_clients(self) -> int:
    return self.experiment.config.clients

  def _wait_for_nodes(self, grid: "flwr_serverapp.Grid", timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
      nodes = sorted(grid.get_node_ids())
      if len(nodes) >= self.num_clients or time.monotonic() > deadline:
        break
      time.sleep(0.5)
    if len(nodes) < self.num_clients:
      raise RuntimeError(f"{len(nodes)} Flower nodes connected within {timeout} s, "
                         f"the experiment has clients={self.num_clients}.")
    return nodes

  def register(self, grid: "flwr_serverapp.Grid", timeout: float) -> None:
    """Asks every node for its client id and data summary; builds the initial state."""
    nodes = self._wait_for_nodes(grid, timeout)
    query = lambda: flwr_app.RecordDict({"config": flwr_app.ConfigRecord(
        {"experiment": self.experiment.to_json()})})
    replies = grid.send_and_receive(
        [flwr_app.Message(content=query(), dst_node_id=n, message_type=QUERY)
         for n in nodes], timeout=timeout)
    summaries = {}
    for reply in replies:
      if reply.has_error():
        raise RuntimeError(f"node {reply.metadata.src_node_id} failed to register: "
                           f"{reply.error.reason}")
      m = reply.content["summary"]
      client = int(m["client"])
      if not 0 <= client < self.num_clients or client in summaries:
        raise RuntimeError(f"node {reply.metadata.src_node_id} registered as client "
                           f"{client}: each of 0..{self.num_clients - 1} must be one "
                           "node's partition-id, once.")
      summaries[client] = m
      self.nodes[client] = reply.metadata.src_node_id
    if len(summaries) != self.num_clients:
      missing = sorted(set(range(self.num_clients)) - set(summaries))
      raise RuntimeError(f"clients {missing} did not register within {timeout} s.")
    first = summaries[0]
    self.input_shape = tuple(int(d) for d in first["input-shape"])
    self.class_counts = np.array([summaries[i]["class-counts"]
                                  for i in range(self.num_clients)], np.int32)
    self.tests = np.array([summaries[i]["tests"] for i in range(self.num_clients)])
    self._algorithm, self.model = self.experiment.build(self.input_shape,
                                                        self.class_counts.shape[1])
    self._state = protocol.initial_state(
        self._algorithm, self.model, np.zeros((1, *self.input_shape), np.float32),
        self.class_counts, self.experiment.seed)

  def _train_message(self, client: int, phase: str, server_round: int, params: Any,
                     context: Any, key: np.ndarray, epochs: int) -> "flwr_app.Message":
    content = _packed({"model": params, "context": context}, flwr_app.ConfigRecord({
        "client": client, "phase": phase, "key": [int(k) for k in key],
        "epochs": epochs, "batch-size": self.experiment.config.batch_size}))
    return flwr_app.Message(content=content,
                            dst_node_id=self.nodes[client], message_type=TRAIN,
                            group_id=str(server_round))

  def _uploads(self, replies: Iterable["flwr_app.Message"], expected: Iterable[int]
               ) -> tuple[dict[int, Any], dict[int, float], int]:
    """`(uploads, losses, bytes)` of the well-formed replies of `expected` clients."""
    expected = set(expected)
    uploads, losses, received = {}, {}, 0
    starts = self._tasks.starts
    for reply in replies:
      if reply.has_error():
        LOG.warning("node %s: %s", reply.metadata.src_node_id, reply.error.reason)
        continue
      try:
        client = int(reply.content["metrics"]["client"])
        if client not in expected or self.nodes[client] != reply.metadata.src_node_id:
          raise ValueError(f"a reply for client {client} from node "
                           f"{reply.metadata.src_node_id}, which was not asked")
        uploads[client] = _unpacked(reply.content, {"model": _row(starts, client)},
                                    f"client {client}'s model")["model"]
        losses[client] = float(reply.content["metrics"]["loss"])
        received += reply.content["arrays"].count_bytes()
      except (KeyError, ValueError, TypeError) as e:
        LOG.warning("dropped a malformed reply: %s", e)
    return uploads, losses, received

  def warm_up(self, grid: "flwr_serverapp.Grid", timeout: float) -> None:
    """The algorithm's warm-up (`Algorithm.warmup`): every client trains once."""
    warmup = self._algorithm.warmup
    m = self.num_clients
    self._tasks = protocol.Tasks(np.arange(m), self._algorithm.client_models(self._state),
                                 self._algorithm.client_context(self._state),
                                 protocol.warmup_keys(self.experiment.seed, m), None)
    messages = [self._train_message(i, "warmup", 0, _row(self._tasks.starts, i),
                                    None if self._tasks.contexts is None
                                    else _row(self._tasks.contexts, i),
                                    self._tasks.keys[i], warmup.epochs)
                for i in range(m) if self.nodes[i] in set(grid.get_node_ids())]
    uploads, _, _ = self._uploads(grid.send_and_receive(messages, timeout=timeout),
                                  range(m))
    self._state = protocol.warmup_step(self._algorithm, self._state, uploads)

  # Flower's Strategy.

  def start(self, grid: "flwr_serverapp.Grid", initial_arrays: Any = None,
            num_rounds: int | None = None, timeout: float = 3600.0,
            train_config: Any = None, evaluate_config: Any = None,
            evaluate_fn: Any = None) -> Any:
    """Registers the clients, warms up, and runs `num_rounds` (default
    `config.rounds`) rounds. `initial_arrays` is ignored: the initial models
    come from the seed, as in `pflax.simulate`."""
    del initial_arrays
    self._started = time.perf_counter()
    self.register(grid, timeout)
    if self._algorithm.warmup is not None:
      self.warm_up(grid, timeout)
    result = super().start(grid, flwr_app.ArrayRecord(),
                           num_rounds=num_rounds or self.experiment.config.rounds,
                           timeout=timeout, train_config=train_config,
                           evaluate_config=evaluate_config, evaluate_fn=evaluate_fn)
    return result

  def configure_train(self, server_round: int, arrays: Any, config: Any,
                      grid: "flwr_serverapp.Grid") -> list["flwr_app.Message"]:
    del arrays, config
    cfg = self.experiment.config
    self._tasks = protocol.round_tasks(self._algorithm, self._state, self.experiment.seed,
                                       server_round - 1, self.num_clients,
                                       cfg.participation)
    online = set(grid.get_node_ids())
    messages = [self._train_message(
        int(i), "train", server_round, _row(self._tasks.starts, i),
        None if self._tasks.contexts is None else _row(self._tasks.contexts, i),
        self._tasks.keys[i], cfg.local_epochs)
                for i in self._tasks.clients if self.nodes[int(i)] in online]
    self.bytes_per_round.append({"train_sent": sum(
        m.content["arrays"].count_bytes() for m in messages)})
    return messages

  def aggregate_train(self, server_round: int, replies: Iterable["flwr_app.Message"]
                      ) -> tuple[None, "flwr_app.MetricRecord"]:
    uploads, losses, received = self._uploads(replies, self._tasks.clients)
    self._state, healthy = protocol.server_step(self._algorithm, self._state,
                                                self._tasks, uploads)
    took_part = np.zeros(self.num_clients, bool)
    took_part[self._tasks.clients] = True
    kept = [losses[i] for i in np.flatnonzero(healthy)]
    loss = float(np.sum(kept) / max(len(kept), 1))
    dropped = tuple(int(i) for i in np.flatnonzero(took_part & ~healthy))
    self.bytes_per_round[-1]["train_received"] = received
    self.history.append(records.RoundRecord(round=server_round, train_loss=loss,
                                            dropped_clients=dropped))
    if not self._due(server_round):
      self._finish_round()
    return None, flwr_app.MetricRecord({"train_loss": loss, "aggregated": len(kept),
                                        "dropped": len(dropped)})

  def _due(self, server_round: int) -> bool:
    cfg = self.experiment.config
    return server_round % cfg.eval_every == 0 or server_round == cfg.rounds

  def _finish_round(self) -> None:
    self.bytes_per_round[-1].setdefault("evaluate_sent", 0)
    if self.on_round:
      self.on_round(self.history[-1])

  def configure_evaluate(self, server_round: int, arrays: Any, config: Any,
                         grid: "flwr_serverapp.Grid") -> list["flwr_app.Message"]:
    del arrays, config
    if not self._due(server_round):
      return []
    held = self._algorithm.evaluate(self._state)
    online = set(grid.get_node_ids())
    messages = [flwr_app.Message(
        content=_packed({kind: _row(models, i) for kind, models in held.items()},
                        flwr_app.ConfigRecord({"client": i, "kinds": list(held)})),
        dst_node_id=node, message_type=EVALUATE, group_id=str(server_round))
                for i, node in self.nodes.items() if node in online]
    self.bytes_per_round[-1]["evaluate_sent"] = sum(
        m.content["arrays"].count_bytes() for m in messages)
    return messages

  def aggregate_evaluate(self, server_round: int,
                         replies: Iterable["flwr_app.Message"]
                         ) -> "flwr_app.MetricRecord | None":
    if not self._due(server_round):
      return None
    kinds = tuple(self._algorithm.evaluate(self._state))
    correct = {kind: np.zeros(self.num_clients, np.int64) for kind in kinds}
    tests = np.zeros(self.num_clients, np.int64)
    for reply in replies:
      if reply.has_error():
        LOG.warning("node %s: %s", reply.metadata.src_node_id, reply.error.reason)
        continue
      try:
        m = reply.content["metrics"]
        client = int(m["client"])
        if self.nodes.get(client) != reply.metadata.src_node_id:
          raise ValueError(f"an evaluation of client {client} from node "
                           f"{reply.metadata.src_node_id}")
        counts = {kind: int(m[f"correct-{kind}"]) for kind in kinds}
        if not all(0 <= c <= self.tests[client] for c in counts.values()):
          raise ValueError(f"client {client}'s correct counts {counts} are not in "
                           f"[0, {self.tests[client]}]")
      except (KeyError, ValueError, TypeError) as e:
        LOG.warning("dropped a malformed evaluation: %s", e)
        continue
      tests[client] = self.tests[client]
      for kind in kinds:
        correct[kind][client] = counts[kind]
    accuracies = {kind: records.Accuracy.of(c, tests) for kind, c in correct.items()}
    self.history[-1] = dataclasses.replace(self.history[-1], accuracies=accuracies)
    self._finish_round()
    return flwr_app.MetricRecord({f"{kind}_accuracy": a.accuracy
                                  for kind, a in accuracies.items()})

  def summary(self) -> None:
    LOG.info("pflax %s on %d clients, seed %d", self.experiment.algorithm,
             self.num_clients, self.experiment.seed)

  # The run's records.

  def run_record(self) -> records.RunRecord:
    """The run so far as `pflax.simulate.RunRecord`."""
    held = self._algorithm.evaluate(self._state)["personalized"]
    seconds = time.perf_counter() - self._started if self._started else 0.0
    return records.RunRecord(algorithm=self.experiment.algorithm, seed=self.experiment.seed,
                             history=tuple(self.history), seconds=seconds,
                             output_norms=np.asarray(engine.output_norms(held)))

  def results(self) -> records.Results:
    """The run as the `results.json` of `pflax-run` (its `config` with a "flower"
    entry: Flower's version and the bytes per round)."""
    config = {**dataclasses.asdict(self.experiment.config),
              "algorithms": [self.experiment.algorithm], "seeds": [self.experiment.seed],
              "flower": {"version": flwr.__version__,
                         "bytes_per_round": self.bytes_per_round}}
    return records.Results(config, self.class_counts, (self.run_record(),))


# --- the clients -----------------------------------------------------------

ClientDataFn = Callable[["flwr_app.Context", Experiment], protocol.ClientData]
"""`data(context, experiment) -> ClientData`: a client's own data."""


def client_id(context: "flwr_app.Context") -> int:
  """The client this node is: `node_config["partition-id"]`."""
  try:
    return int(context.node_config["partition-id"])
  except KeyError:
    raise ValueError("a pflax Flower node needs node_config partition-id (its client "
                     "id): flower-supernode --node-config 'partition-id=0'") from None


@functools.lru_cache(maxsize=4)
def _simulated_federation(experiment_json: str):
  experiment = Experiment.from_json(experiment_json)
  return simulate.prepare(experiment.config, experiment.seed).federation


def simulated_partition(context: "flwr_app.Context", experiment: Experiment
                        ) -> protocol.ClientData:
  """The node's client of the simulated partition (`pflax.simulate.prepare` with
  the experiment's seed): client `partition-id`'s rows. Every node prepares the
  same partition and keeps its own part, as `pflax.simulate` splits the data."""
  client = client_id(context)
  federation = _simulated_federation(experiment.to_json())
  if not 0 <= client < federation.x.shape[0]:
    raise ValueError(f"partition-id must be in [0, {federation.x.shape[0]}), got "
                     f"{client}.")
  return protocol.client_data(federation, client)


class _Client:
  """A node's experiment: its algorithm, model and data (one per experiment)."""

  def __init__(self, experiment: Experiment, data: protocol.ClientData, client: int):
    self.experiment, self.data, self.client = experiment, data, client
    self.input_shape = tuple(int(d) for d in data.x.shape[1:])
    self.algorithm, self.model = _built(experiment.to_json(), self.input_shape,
                                        data.num_classes)
    counts = protocol.training_class_counts(data)
    shapes = jax.eval_shape(lambda: _one_client_templates(
        self.algorithm, self.model, self.input_shape, counts))
    self.start_like, self.context_like, self.model_like = shapes

  def summary(self) -> "flwr_app.MetricRecord":
    return flwr_app.MetricRecord({
        "client": self.client,
        "class-counts": protocol.training_class_counts(self.data).tolist(),
        "input-shape": list(self.input_shape),
        "tests": int(np.sum(self.data.test_valid))})


@functools.lru_cache(maxsize=8)
def _built(experiment_json: str, input_shape: tuple[int, ...], num_classes: int
           ) -> tuple[alg.Algorithm, Any]:
  """One `(algorithm, model)` per experiment and process, so that the clients of
  one process (in-process grids, Ray actors) share their compiled programs."""
  return Experiment.from_json(experiment_json).build(input_shape, num_classes)


def _one_client_templates(algorithm: alg.Algorithm, model: Any,
                          input_shape: tuple[int, ...], counts: np.ndarray) -> Any:
  """A client's starting model, loss context and plain model (for shapes only)."""
  state = protocol.initial_state(algorithm, model, np.zeros((1, *input_shape),
                                                           np.float32),
                                 counts[None], 0)
  context = algorithm.client_context(state)
  return (_row_traced(algorithm.client_models(state)),
          None if context is None else _row_traced(context),
          model.init(jax.random.key(0), np.zeros((1, *input_shape), np.float32))["params"])


def _row_traced(stacked: Any) -> Any:
  return jax.tree.map(lambda x: x[0], stacked)


OPT_STATE = "pflax.opt_state"
EXPERIMENT = "pflax.experiment"


def client_app(data: ClientDataFn = simulated_partition) -> "flwr_clientapp.ClientApp":
  """A Flower ClientApp training pflax's algorithms (see the module docstring).

  Args:
    data: the node's own data, `data(context, experiment) -> ClientData`
      (default: its client of the simulated partition).
  """
  app = flwr_clientapp.ClientApp()
  clients: dict[tuple[str, int], _Client] = {}

  def experiment_client(context, text: str) -> _Client:
    key = (text, client_id(context))
    if key not in clients:
      experiment = Experiment.from_json(text)
      clients[key] = _Client(experiment, data(context, experiment), key[1])
    return clients[key]

  def current(context) -> _Client:
    if EXPERIMENT not in context.state:
      raise RuntimeError("this node was not registered: the server's query comes first.")
    return experiment_client(context, context.state[EXPERIMENT]["json"])

  @app.query()
  def register(message, context):
    text = str(message.content["config"]["experiment"])
    context.state[EXPERIMENT] = flwr_app.ConfigRecord({"json": text})
    client = experiment_client(context, text)
    return flwr_app.Message(flwr_app.RecordDict({"summary": client.summary()}),
                            reply_to=message)

  @app.train()
  def train(message, context):
    client = current(context)
    config = message.content["config"]
    if int(config["client"]) != client.client:
      raise ValueError(f"a task for client {config['client']} reached client "
                       f"{client.client}.")
    sent = _unpacked(message.content, {"model": client.start_like,
                                       "context": client.context_like}, "train message")
    params, context_ = sent["model"], sent["context"]
    algorithm = client.algorithm
    keeps = algorithm.keep_opt_state and config["phase"] == "train"
    opt_state = None
    if keeps and OPT_STATE in context.state:
      like = jax.eval_shape(algorithm.optimizer.init, params)
      opt_state = from_record(context.state[OPT_STATE], like, "optimizer state")
    result = protocol.client_update(
        algorithm, params, opt_state, context_, client.data,
        protocol.key_from_data(config["key"]), epochs=int(config["epochs"]),
        batch_size=int(config["batch-size"]))
    if keeps and protocol.finite(result.params):
      context.state[OPT_STATE] = to_record(result.opt_state)
    return flwr_app.Message(_packed({"model": result.params}, flwr_app.MetricRecord({
        "client": client.client, "loss": float(result.loss),
        "num-examples": int(np.sum(client.data.valid))}), "metrics"), reply_to=message)

  @app.evaluate()
  def evaluate(message, context):
    client = current(context)
    kinds = [str(kind) for kind in message.content["config"]["kinds"]]
    held = _unpacked(message.content, {kind: client.model_like for kind in kinds},
                     "evaluate message")
    metrics = {"client": client.client, "tests": int(np.sum(client.data.test_valid))}
    for kind, params in held.items():
      metrics[f"correct-{kind}"] = protocol.correct_predictions(client.model, params,
                                                                client.data)
    return flwr_app.Message(flwr_app.RecordDict({
        "metrics": flwr_app.MetricRecord(metrics)}), reply_to=message)

  return app


def server_app(experiment: Experiment | None = None,
               on_results: Callable[[records.Results], None] | None = None,
               on_round: Callable[[records.RoundRecord], None] | None = None
               ) -> "flwr_serverapp.ServerApp":
  """A Flower ServerApp that runs one experiment with `PflaxStrategy`.

  Args:
    experiment: what to run; None reads it from the run config (Flower's
      deployment engine: `flwr run --run-config`).
    on_results: called with the run's `Results` at the end.
    on_round: called with each round's `RoundRecord`.

  Run config keys: `experiment` (the `Experiment` as JSON, when `experiment`
  is None), `out` (a directory for `results.json`, written after every round;
  "" for none) and `timeout` (seconds to wait for replies).
  """
  app = flwr_serverapp.ServerApp()

  @app.main()
  def main(grid, context):
    run_config = context.run_config
    chosen = experiment or Experiment.from_json(str(run_config["experiment"]))
    out = str(run_config.get("out", ""))
    if out:
      os.makedirs(out, exist_ok=True)

    def after_round(record: records.RoundRecord) -> None:
      if out:
        strategy.results().save(_results_path(out))
      if on_round:
        on_round(record)

    strategy = PflaxStrategy(chosen, on_round=after_round)
    strategy.start(grid, timeout=float(run_config.get("timeout", 600.0)))
    results = strategy.results()
    if out:
      results.save(_results_path(out))
    if on_results:
      on_results(results)

  return app


def _results_path(out: str) -> str:
  return os.path.join(out, "results.json")


# --- one process, no network ------------------------------------------------

class InProcessGrid(flwr_serverapp.Grid):
  """A Flower Grid that delivers each message to a ClientApp in this process.

  Every message and reply is a real Flower message (the arrays serialized
  as in a federation), handled synchronously, with no SuperLink or network:
  for tests, notebooks and debugging. A handler that raises gives an error
  reply, as a SuperNode does; `lost(message)` True drops a message's reply
  (a client that disconnected mid-round).

  Args:
    nodes: `{node_id: (client_app, context)}`.
    lost: optionally, which messages' replies never arrive.
  """

  def __init__(self, nodes: Mapping[int, tuple[Any, Any]],
               lost: Callable[["flwr_app.Message"], bool] | None = None):
    self.nodes = dict(nodes)
    self.lost = lost or (lambda message: False)
    self._replies: dict[str, "flwr_app.Message"] = {}
    self._run = None

  def set_run(self, run: Any) -> None:
    self._run = run

  @property
  def run(self) -> Any:
    return self._run

  def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
    return flwr_app.Message(content=content, dst_node_id=dst_node_id,
                            message_type=message_type, group_id=group_id, ttl=ttl)

  def get_node_ids(self) -> list[int]:
    return list(self.nodes)

  def _deliver(self, message: "flwr_app.Message") -> "flwr_app.Message":
    app, context = self.nodes[message.metadata.dst_node_id]
    try:
      return app(message, context)
    except Exception as e:  # pylint: disable=broad-except  # as a SuperNode does
      return flwr_app.Message(flwr_app.Error(code=0, reason=f"{type(e).__name__}: {e}"),
                              reply_to=message)

  def push_messages(self, messages: Iterable["flwr_app.Message"]) -> list[str]:
    ids = []
    for message in messages:
      reply = self._deliver(message)
      message_id = str(len(self._replies))
      if not self.lost(message):
        self._replies[message_id] = reply
      ids.append(message_id)
    return ids

  def pull_messages(self, message_ids: Iterable[str]) -> list["flwr_app.Message"]:
    return [self._replies.pop(i) for i in message_ids if i in self._replies]

  def send_and_receive(self, messages, *, timeout=None):
    del timeout
    return self.pull_messages(self.push_messages(messages))


def in_process_nodes(num_clients: int, app: Any = None,
                     node_config: Callable[[int], dict[str, Any]] | None = None
                     ) -> dict[int, tuple[Any, Any]]:
  """`{node_id: (client_app, context)}` of `num_clients` nodes, client i on node
  `i + 1` with `partition-id = i`, for `InProcessGrid`."""
  app = app or client_app()
  config = node_config or (lambda i: {"partition-id": i,
                                      "num-partitions": num_clients})
  return {i + 1: (app, flwr_app.Context(run_id=1, node_id=i + 1,
                                        node_config=config(i),
                                        state=flwr_app.RecordDict(), run_config={}))
          for i in range(num_clients)}


def run_in_process(experiment: Experiment, grid: InProcessGrid | None = None
                   ) -> PflaxStrategy:
  """Runs `experiment` through `PflaxStrategy` and `client_app()` in this process
  (`InProcessGrid`, default: one node per client); returns the strategy, whose
  `results()` hold the run."""
  from flwr.supercore import task_identity  # pylint: disable=import-outside-toplevel
  identity = task_identity.TaskIdentity
  previous = (identity._run_id, identity._node_id, identity._task_id)  # pylint: disable=protected-access
  identity.run_id, identity.node_id, identity.task_id = 1, 0, 0
  try:
    grid = grid or InProcessGrid(in_process_nodes(experiment.config.clients))
    strategy = PflaxStrategy(experiment)
    strategy.start(grid, timeout=0.0)
    return strategy
  finally:
    identity.run_id, identity.node_id, identity.task_id = previous

