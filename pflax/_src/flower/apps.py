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

Every key is drawn as the engine draws it (`pflax._src.simulation.protocol`), so a
federation reproduces `pflax.simulate.run` with the same experiment and seed.
Arrays travel as NumPy's `.npy` bytes (Flower's `Array`), which load without
pickle, each distinct array of a message once (`pack`): a loss context equal
to the model (FedProx's anchor), or an evaluated kind equal to another
(FedAvg's global and personalized models), costs no bytes. The optimizer state
a client keeps between rounds (FedReMa's momentum) stays in its `Context`.
What the server computes from the uploads (class counts from the output
layer, FedReMa's soft logits on its probe, FedDWA's similarities) needs no
extra message: the class counts of cwFedAvg travel once, at registration.

Nothing a node sends is trusted. Each array's `.npy` header is compared with
the expected leaf (shape, dtype, C order) before its data is read, and every
number is checked: counts are integers in `[0, MAX_COUNT]`, a loss is finite,
an evaluation has `correct <= tests <=` the test samples its client registered.
A `train` or `evaluate` reply that fails any check, or fails to decode in any
way, drops its client from that round (`dropped_clients`, or left out of the
round's accuracy) and nobody else. A registration that fails a check (class
counts that are negative, too large or of another K than the other clients',
the federation's counts summing past `MAX_COUNT`, another input shape) refuses
the run before round 1 with an error naming the node and client: the initial
state needs every client's class counts.
"""

import collections
import dataclasses
import functools
import io
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

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
  from flwr.common.constant import SType
  from flwr.serverapp import strategy as flwr_strategy
except ImportError as e:  # pragma: no cover - exercised without the extra
  raise ImportError("pflax.flower needs Flower: pip install 'pflax[flower]'") from e

from pflax._src.data import federation as federation_lib
from pflax._src.methods import algorithm as alg
from pflax._src.simulation import engine
from pflax._src.simulation import protocol
from pflax._src.simulation import records
from pflax._src.simulation import simulate

LOG = logging.getLogger("pflax.flower")
QUERY, TRAIN, EVALUATE = "query", "train", "evaluate"


# --- trees as Flower records ------------------------------------------------

def to_record(tree: Any) -> "flwr_app.ArrayRecord":
  """A pytree as an ArrayRecord, one `Array` per leaf named by its key path."""
  return flwr_app.ArrayRecord({jax.tree_util.keystr(path): flwr_app.Array(
      np.asarray(leaf)) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)})


def from_record(record: "flwr_app.ArrayRecord", like: Any, name: str = "record") -> Any:
  """The pytree of `like`'s structure, shapes and dtypes stored in `record`;
  each array's `.npy` header is checked before its data is read (`_decoded`).

  Raises:
    ValueError: naming `name` and the first key missing, unexpected, or of
      another shape or dtype than `like`'s, or bytes that are not its `.npy`.
  """
  paths = jax.tree_util.tree_leaves_with_path(like)
  expected = {jax.tree_util.keystr(path): leaf for path, leaf in paths}
  extra = sorted(set(record) - set(expected))
  missing = sorted(set(expected) - set(record))
  if extra or missing:
    raise ValueError(f"{name}: keys {missing} missing and {extra} unexpected.")
  leaves = [_decoded(record[key], leaf, f"{name}{key}")
            for key, leaf in expected.items()]
  return jax.tree.unflatten(jax.tree.structure(like), leaves)


_NPY_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0}


def _decoded(array: "flwr_app.Array", like: Any, name: str = "array") -> np.ndarray:
  """The array of `like`'s shape and dtype that `array`'s `.npy` bytes hold.

  The `.npy` header (shape, dtype, order) is read and compared with `like`
  before anything is allocated, and the payload must be exactly that many bytes:
  bytes from another machine cannot make this allocate more than `like` (a header
  declaring 10**12 elements) or load a pickle (an object dtype).

  Raises:
    ValueError: naming `name`, for bytes that are not `.npy` of a C-ordered
      array of `like`'s shape and dtype.
  """
  shape, dtype = tuple(np.shape(like)), np.dtype(like.dtype)
  if array.stype != SType.NUMPY:
    raise ValueError(f"{name} must be serialized as {SType.NUMPY}, got "
                     f"{array.stype!r}.")
  stream = io.BytesIO(array.data)
  try:
    version = np.lib.format.read_magic(stream)
    if version not in _NPY_HEADERS:
      raise ValueError(f"format version {version} is not read")
    got_shape, fortran, got_dtype = _NPY_HEADERS[version](stream)
  except ValueError as e:
    raise ValueError(f"{name} is not .npy bytes: {e}.") from None
  if got_shape != shape or got_dtype != dtype:
    raise ValueError(f"{name} must be {dtype}{shape}, got {got_dtype}{got_shape}.")
  if fortran:
    raise ValueError(f"{name} must be in C order, got Fortran order.")
  size = math.prod(shape) * dtype.itemsize
  if len(array.data) - stream.tell() != size:
    raise ValueError(f"{name} must hold {size} bytes after its header, got "
                     f"{len(array.data) - stream.tell()}.")
  return np.frombuffer(array.data, dtype, math.prod(shape), stream.tell()
                       ).reshape(shape).copy()


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


# --- the numbers a node declares ---------------------------------------------

MAX_COUNT = 2**31 - 1
"""The largest count a node may declare, and the largest sum of the federation's
training class counts: the algorithms add class counts in int32."""


def _count(value: Any, name: str, most: int = MAX_COUNT) -> int:
  """`value` as an int in `[0, most]`; ValueError naming `name` for anything else
  (a float, a bool, inf, a negative or larger number)."""
  if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))
      or not 0 <= value <= most):
    raise ValueError(f"{name} must be an integer in [0, {most}], got {value!r}.")
  return int(value)


def _finite(value: Any, name: str) -> float:
  """`value`, a float, if it is finite; ValueError naming `name` for anything else."""
  if not isinstance(value, (float, np.floating)) or not math.isfinite(value):
    raise ValueError(f"{name} must be a finite number, got {value!r}.")
  return float(value)


def _reason(error: Exception) -> str:
  return f"{type(error).__name__}: {error}"


class _Registration(NamedTuple):
  """What a node declares once, at registration (`_registration` checks it)."""
  class_counts: tuple[int, ...]
  input_shape: tuple[int, ...]
  tests: int


def _registration(summary: "flwr_app.MetricRecord", num_clients: int
                  ) -> tuple[int, _Registration]:
  """`(client, registration)` of a `query` reply's summary.

  Raises:
    ValueError: for a client id outside `[0, num_clients)`, class counts that
      are not a non-empty list of integers in `[0, MAX_COUNT]`, an input shape
      that is not a non-empty list of positive integers, a test count that is
      not an integer in `[0, MAX_COUNT]`.
  """
  client = _count(summary["client"], "client (the node's partition-id)",
                  num_clients - 1)
  counts, shape = summary["class-counts"], summary["input-shape"]
  if not isinstance(counts, list) or not counts:
    raise ValueError(f"client {client}'s class-counts must be a non-empty list of "
                     f"integers, got {counts!r}.")
  if not isinstance(shape, list) or not shape:
    raise ValueError(f"client {client}'s input-shape must be a non-empty list of "
                     f"integers, got {shape!r}.")
  counts = tuple(_count(c, f"client {client}'s class-counts[{j}]")
                 for j, c in enumerate(counts))
  shape = tuple(_count(d, f"client {client}'s input-shape[{j}]") for j, d in
                enumerate(shape))
  if min(shape) < 1:
    raise ValueError(f"client {client}'s input-shape must be positive, got {shape}.")
  return client, _Registration(counts, shape, _count(summary["tests"],
                                                     f"client {client}'s tests"))


def _agreed(values: Mapping[int, Any], what: str) -> Any:
  """The value of `{client: value}` that most clients registered.

  Raises:
    RuntimeError: naming the first client that registered another value
      (`what.format(value)` says what it is).
  """
  common, _ = collections.Counter(values.values()).most_common(1)[0]
  for client, value in values.items():
    if value != common:
      raise RuntimeError(f"client {client} registered {what.format(value)}, most "
                         f"clients {what.format(common)}: the clients of a federation "
                         "hold data of one kind.")
  return common


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
    """Asks every node for its client id and data summary; builds the initial state.

    Raises:
      RuntimeError: naming the node or client, for a node that fails or sends
        an invalid registration (`_registration`), clients that register other
        input shapes or K, class counts summing past `MAX_COUNT`, a client id
        registered twice or not at all.
    """
    nodes = self._wait_for_nodes(grid, timeout)
    query = lambda: flwr_app.RecordDict({"config": flwr_app.ConfigRecord(
        {"experiment": self.experiment.to_json()})})
    replies = grid.send_and_receive(
        [flwr_app.Message(content=query(), dst_node_id=n, message_type=QUERY)
         for n in nodes], timeout=timeout)
    registered: dict[int, _Registration] = {}
    for reply in replies:
      node = reply.metadata.src_node_id
      if reply.has_error():
        raise RuntimeError(f"node {node} failed to register: {reply.error.reason}")
      try:
        client, registration = _registration(reply.content["summary"],
                                             self.num_clients)
      except Exception as e:  # pylint: disable=broad-except  # whatever a node sends
        raise RuntimeError(f"node {node} sent an invalid registration: "
                           f"{_reason(e)}") from None
      if client in registered:
        raise RuntimeError(f"node {node} registered as client {client}, as node "
                           f"{self.nodes[client]} did: each of 0.."
                           f"{self.num_clients - 1} must be one node's partition-id, "
                           "once.")
      registered[client] = registration
      self.nodes[client] = node
    if len(registered) != self.num_clients:
      missing = sorted(set(range(self.num_clients)) - set(registered))
      raise RuntimeError(f"clients {missing} did not register within {timeout} s.")
    registered = dict(sorted(registered.items()))
    self.input_shape = _agreed({c: r.input_shape for c, r in registered.items()},
                               "inputs of shape {}")
    _agreed({c: len(r.class_counts) for c, r in registered.items()}, "{} classes")
    totals = {c: sum(r.class_counts) for c, r in registered.items()}
    if sum(totals.values()) > MAX_COUNT:
      most = max(totals, key=totals.get)
      raise RuntimeError(f"the clients' class counts sum to {sum(totals.values())}, "
                         f"more than {MAX_COUNT} (the algorithms add them in int32); "
                         f"client {most} registered {totals[most]} samples.")
    self.class_counts = np.array([r.class_counts for r in registered.values()],
                                 np.int32)
    self.tests = np.array([r.tests for r in registered.values()], np.int64)
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
    """`(uploads, losses, bytes)` of the valid replies of `expected` clients
    (`_upload`); any other reply, whatever is wrong with it, is logged and left
    out: its client is dropped from the round, the others are not affected."""
    waiting = {int(i) for i in expected}
    uploads, losses, received = {}, {}, 0
    for reply in replies:
      try:
        client, upload, loss = self._upload(reply, waiting)
      except Exception as e:  # pylint: disable=broad-except  # whatever a node sends
        LOG.warning("node %s: reply dropped: %s", reply.metadata.src_node_id,
                    _reason(e))
        continue
      waiting.remove(client)
      uploads[client], losses[client] = upload, loss
      received += reply.content["arrays"].count_bytes()
    return uploads, losses, received

  def _replying_client(self, reply: "flwr_app.Message", waiting: set[int],
                       what: str) -> tuple[Any, int]:
    """`(metrics, client)` of a reply from the node of a client of `waiting`.

    Raises:
      ValueError: the node failed, or replied for a client it was not asked for
        (or one answered already).
    """
    if reply.has_error():
      raise ValueError(f"the node failed: {reply.error.reason}")
    metrics = reply.content["metrics"]
    client = _count(metrics["client"], "client", self.num_clients - 1)
    if client not in waiting or self.nodes[client] != reply.metadata.src_node_id:
      raise ValueError(f"{what} client {client}, which this node was not asked for "
                       "(or that was answered already)")
    return metrics, client

  def _upload(self, reply: "flwr_app.Message", waiting: set[int]
              ) -> tuple[int, Any, float]:
    """`(client, model, loss)` of a `train` reply: from the node of a client of
    `waiting`, a model of its starting model's shapes and dtypes, a finite loss.

    Raises:
      ValueError (or whatever decoding raises): for any other reply.
    """
    metrics, client = self._replying_client(reply, waiting, "a reply for")
    model = _unpacked(reply.content, {"model": _row(self._tasks.starts, client)},
                      f"client {client}'s model")["model"]
    return client, model, _finite(metrics["loss"], f"client {client}'s loss")

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
    self._state = protocol.warmup_step(
        self._algorithm, self._state, uploads,
        outlier_factor=self.experiment.config.outlier_factor)

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
    self._state, healthy = protocol.server_step(
        self._algorithm, self._state, self._tasks, uploads,
        outlier_factor=self.experiment.config.outlier_factor)
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
    waiting = set(range(self.num_clients))
    for reply in replies:
      try:
        client, tested, counts = self._evaluation(reply, kinds, waiting)
      except Exception as e:  # pylint: disable=broad-except  # whatever a node sends
        LOG.warning("node %s: evaluation dropped: %s", reply.metadata.src_node_id,
                    _reason(e))
        continue
      waiting.remove(client)
      tests[client] = tested
      for kind in kinds:
        correct[kind][client] = counts[kind]
    accuracies = {kind: records.Accuracy.of(c, tests) for kind, c in correct.items()}
    self.history[-1] = dataclasses.replace(self.history[-1], accuracies=accuracies)
    self._finish_round()
    return flwr_app.MetricRecord({f"{kind}_accuracy": a.accuracy
                                  for kind, a in accuracies.items()})

  def _evaluation(self, reply: "flwr_app.Message", kinds: tuple[str, ...],
                  waiting: set[int]) -> tuple[int, int, dict[str, int]]:
    """`(client, tests, {kind: correct})` of an `evaluate` reply: from the node of
    a client of `waiting`, with `correct <= tests <=` the test samples that client
    registered, all integers.

    Raises:
      ValueError: for any other reply.
    """
    m, client = self._replying_client(reply, waiting, "an evaluation of")
    tests = _count(m["tests"], f"client {client}'s tests (registered: "
                   f"{self.tests[client]})", int(self.tests[client]))
    return client, tests, {kind: _count(m[f"correct-{kind}"],
                                        f"client {client}'s correct-{kind}", tests)
                           for kind in kinds}

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

ClientDataFn = Callable[["flwr_app.Context", Experiment], federation_lib.ClientData]
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
                        ) -> federation_lib.ClientData:
  """The node's client of the simulated partition (`pflax.simulate.prepare` with
  the experiment's seed): client `partition-id`'s rows. Every node prepares the
  same partition and keeps its own part, as `pflax.simulate` splits the data."""
  client = client_id(context)
  federation = _simulated_federation(experiment.to_json())
  if not 0 <= client < federation.x.shape[0]:
    raise ValueError(f"partition-id must be in [0, {federation.x.shape[0]}), got "
                     f"{client}.")
  return federation.client(client)


class _Client:
  """A node's experiment: its algorithm, model and data (one per experiment)."""

  def __init__(self, experiment: Experiment, data: federation_lib.ClientData,
               client: int):
    self.experiment, self.data, self.client = experiment, data, client
    self.input_shape = tuple(int(d) for d in data.x.shape[1:])
    self.algorithm, self.model = _built(experiment.to_json(), self.input_shape,
                                        data.num_classes)
    counts = data.class_counts()
    shapes = jax.eval_shape(lambda: _one_client_templates(
        self.algorithm, self.model, self.input_shape, counts))
    self.start_like, self.context_like, self.model_like = shapes

  def summary(self) -> "flwr_app.MetricRecord":
    return flwr_app.MetricRecord({
        "client": self.client,
        "class-counts": self.data.class_counts().tolist(),
        "input-shape": list(self.input_shape),
        "tests": int(np.sum(self.data.test_mask))})


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
        "num-examples": int(np.sum(client.data.mask))}), "metrics"), reply_to=message)

  @app.evaluate()
  def evaluate(message, context):
    client = current(context)
    kinds = [str(kind) for kind in message.content["config"]["kinds"]]
    held = _unpacked(message.content, {kind: client.model_like for kind in kinds},
                     "evaluate message")
    metrics = {"client": client.client, "tests": int(np.sum(client.data.test_mask))}
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

