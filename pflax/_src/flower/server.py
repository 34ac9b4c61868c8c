"""The server of a pflax federation: a Flower strategy and its ServerApp.

`PflaxStrategy` registers the nodes, builds the initial state, and runs the
engine's rounds in pieces (`pflax._src.simulation.protocol`): every key is
drawn as the engine draws it, and the server steps are the engine's, over
every architecture group, so a federation reproduces `pflax.simulate.run`
with the same experiment and seed. What the server computes from the uploads
(class counts from the output layer, FedReMa's soft logits on its probe,
FedDWA's similarities) needs no extra message: the class counts of cwFedAvg
travel once, at registration.

Faults of real nodes: a node that does not reply to a round's `train` message
(it hangs, or is gone) is not asked to evaluate in that round, so it costs one
timeout per round, and the round's record names the clients its accuracies
count (`RoundRecord.evaluated_clients`). A node that replied with an error (a
restarted node has lost its registration), or whose node went offline, is asked
to register again before it gets another message, once its node is online (a
new node id may take over a client whose node is gone); the registration must
equal its first one. A round in which every participant is dropped stops the
run (`faults.all_dropped`), as in `pflax.simulate`.
"""

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import flwr
import numpy as np
from flwr import app as flwr_app
from flwr import serverapp as flwr_serverapp
from flwr.serverapp import strategy as flwr_strategy

from pflax._src.flower import experiment as experiment_lib
from pflax._src.flower import replies as replies_lib
from pflax._src.flower import wire
from pflax._src.simulation import engine
from pflax._src.simulation import experiment as simulation_experiment
from pflax._src.simulation import faults as faults_lib
from pflax._src.simulation import protocol
from pflax._src.simulation import records

LOG = logging.getLogger("pflax.flower")


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

  def __init__(self, experiment: experiment_lib.Experiment,
               on_round: Callable[[records.RoundRecord], None] | None = None):
    experiment.check()
    simulation_experiment.warn_participation(experiment.config)
    self.experiment = experiment
    self.on_round = on_round
    self.nodes: dict[int, int] = {}          # client -> node id
    self.registrations: dict[int, replies_lib.Registration] = {}
    self.history: list[records.RoundRecord] = []
    self.bytes_per_round: list[dict[str, int]] = []
    self.groups = None                       # the algorithm, once registered
    self.parts = None                        # the model's parts, once registered
    self._started: float | None = None
    self._state: Any = None
    self._tasks: protocol.Tasks | None = None
    self._timeout = 0.0
    self._asked: dict[int, int] = {}         # client -> node of this round's tasks
    self._silent: set[int] = set()           # asked clients whose node did not reply
    self._stale: set[int] = set()            # clients to register again

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
        an invalid registration (`replies.registration`), clients that
        register other input shapes or K, class counts summing past
        `MAX_COUNT`, a client id registered twice or not at all.
    """
    nodes = self._wait_for_nodes(grid, timeout)
    registered: dict[int, replies_lib.Registration] = {}
    for reply in self._query(grid, nodes, timeout):
      node = reply.metadata.src_node_id
      if reply.has_error():
        raise RuntimeError(f"node {node} failed to register: {reply.error.reason}")
      try:
        client, registration = replies_lib.registration(reply.content["summary"],
                                                        self.num_clients)
      except Exception as e:  # pylint: disable=broad-except  # whatever a node sends
        raise RuntimeError(f"node {node} sent an invalid registration: "
                           f"{replies_lib.reason(e)}") from None
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
    self.registrations = registered
    self.input_shape = replies_lib.agreed(
        {c: r.input_shape for c, r in registered.items()}, "inputs of shape {}")
    replies_lib.agreed({c: len(r.class_counts) for c, r in registered.items()},
                       "{} classes")
    totals = {c: sum(r.class_counts) for c, r in registered.items()}
    if sum(totals.values()) > replies_lib.MAX_COUNT:
      most = max(totals, key=totals.get)
      raise RuntimeError(f"the clients' class counts sum to {sum(totals.values())}, "
                         f"more than {replies_lib.MAX_COUNT} (the algorithms add them "
                         f"in int32); client {most} registered {totals[most]} "
                         "samples.")
    self.class_counts = np.array([r.class_counts for r in registered.values()],
                                 np.int32)
    self.tests = np.array([r.tests for r in registered.values()], np.int64)
    self.groups, self.parts = self.experiment.build(self.input_shape,
                                                    self.class_counts.shape[1])
    self._state = engine.initial_state(
        self.groups, np.zeros((1, *self.input_shape), np.float32), self.class_counts,
        self.experiment.seed)

  def _query(self, grid: "flwr_serverapp.Grid", nodes: Iterable[int],
             timeout: float, group: str = "") -> list["flwr_app.Message"]:
    """The replies of `nodes` to the registration query (the experiment)."""
    query = lambda: flwr_app.RecordDict({"config": flwr_app.ConfigRecord(
        {"experiment": self.experiment.to_json()})})
    return list(grid.send_and_receive(
        [flwr_app.Message(content=query(), dst_node_id=n, message_type=wire.QUERY,
                          group_id=group) for n in nodes], timeout=timeout))

  def _rejoin(self, grid: "flwr_serverapp.Grid", online: set[int],
              server_round: int) -> None:
    """Registers again the clients of `self._stale` and those whose node is
    offline: their own node once it is online, and any online node that is no
    client's (a restarted node without a key of its own gets a new node id).
    A client whose registration is accepted (`_rejoined`) leaves `_stale`."""
    missing = self._stale | {c for c, n in self.nodes.items() if n not in online}
    known = set(self.nodes.values())
    asked = ({self.nodes[c] for c in missing} & online) | (online - known)
    self._stale = missing
    if not missing or not asked:
      return
    for reply in self._query(grid, sorted(asked), self._timeout, str(server_round)):
      try:
        client = self._rejoined(reply, online)
      except Exception as e:  # pylint: disable=broad-except  # whatever a node sends
        LOG.warning("node %s: not registered again: %s", reply.metadata.src_node_id,
                    replies_lib.reason(e))
        continue
      LOG.info("client %d registered again, on node %d", client,
               reply.metadata.src_node_id)
      self.nodes[client] = reply.metadata.src_node_id
      self._stale.discard(client)

  def _rejoined(self, reply: "flwr_app.Message", online: set[int]) -> int:
    """The client of a registration reply that may register again: one of
    `self._stale`, from its own node or from a new node while its own is offline,
    with its first registration.

    Raises:
      ValueError (or whatever decoding raises): for any other reply.
    """
    if reply.has_error():
      raise ValueError(f"the node failed: {reply.error.reason}")
    client, registration = replies_lib.registration(reply.content["summary"],
                                                    self.num_clients)
    node, own = reply.metadata.src_node_id, self.nodes[client]
    if client not in self._stale:
      raise ValueError(f"it registered as client {client}, which is registered.")
    if node != own and (own in online or node in self.nodes.values()):
      raise ValueError(f"it registered as client {client}, node {own}'s client.")
    if registration != self.registrations[client]:
      raise ValueError(f"client {client} registered {registration}, first "
                       f"{self.registrations[client]}.")
    return client

  def _note_replies(self, replies: list["flwr_app.Message"], asked: dict[int, int]
                    ) -> None:
    """Marks the clients of `asked` ({client: node}) whose node sent no reply as
    `_silent`, those whose node replied with an error as `_stale`."""
    replied = {r.metadata.src_node_id: r.has_error() for r in replies}
    self._silent = {c for c, n in asked.items() if n not in replied}
    self._stale |= {c for c, n in asked.items() if replied.get(n)}

  def _train_messages(self, grid: "flwr_serverapp.Grid", phase: str,
                      server_round: int, epochs: int) -> list["flwr_app.Message"]:
    """A `train` message of `self._tasks` to each of its clients that is online
    and registered (`_rejoin` first)."""
    online = set(grid.get_node_ids())
    self._rejoin(grid, online, server_round)
    messages, self._asked = [], {}
    for i in (int(i) for i in self._tasks.clients):
      if self.nodes[i] not in online or i in self._stale:
        continue
      self._asked[i] = self.nodes[i]
      start, context, key = protocol.client_task(self.groups, self._tasks, i)
      content = wire.packed({"model": start, "context": context}, flwr_app.ConfigRecord({
          "client": i, "phase": phase, "key": [int(k) for k in key],
          "epochs": epochs, "batch-size": self.experiment.config.batch_size}))
      messages.append(flwr_app.Message(content=content, dst_node_id=self.nodes[i],
                                       message_type=wire.TRAIN,
                                       group_id=str(server_round)))
    return messages

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
                    replies_lib.reason(e))
        continue
      waiting.remove(client)
      uploads[client], losses[client] = upload, loss
      received += reply.content["arrays"].count_bytes()
    return uploads, losses, received

  def _upload(self, reply: "flwr_app.Message", waiting: set[int]
              ) -> tuple[int, Any, float]:
    """`(client, model, loss)` of a `train` reply: from the node of a client of
    `waiting`, a model of its starting model's shapes and dtypes, a finite loss.

    Raises:
      ValueError (or whatever decoding raises): for any other reply.
    """
    metrics, client = replies_lib.replying_client(reply, waiting, self.nodes,
                                              "a reply for")
    like = protocol.client_row(self.groups, self._tasks.starts, client)
    model = wire.unpacked(reply.content, {"model": like},
                          f"client {client}'s model")["model"]
    return client, model, replies_lib.training_loss(metrics["loss"],
                                                f"client {client}'s loss")

  def warm_up(self, grid: "flwr_serverapp.Grid", timeout: float) -> None:
    """The algorithm's warm-up (`Algorithm.warmup`): every client trains once."""
    self._tasks = protocol.warmup_tasks(self.groups, self._state, self.experiment.seed)
    messages = self._train_messages(grid, "warmup", 0,
                                    self.groups.algorithm.warmup.epochs)
    replies = list(grid.send_and_receive(messages, timeout=timeout))
    self._note_replies(replies, self._asked)
    uploads, _, _ = self._uploads(replies, self._tasks.clients)
    self._state = protocol.warmup_step(
        self.groups, self._state, uploads,
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
    self._timeout = timeout
    self.register(grid, timeout)
    if self.groups.algorithm.warmup is not None:
      self.warm_up(grid, timeout)
    return super().start(grid, flwr_app.ArrayRecord(),
                         num_rounds=num_rounds or self.experiment.config.rounds,
                         timeout=timeout, train_config=train_config,
                         evaluate_config=evaluate_config, evaluate_fn=evaluate_fn)

  def configure_train(self, server_round: int, arrays: Any, config: Any,
                      grid: "flwr_serverapp.Grid") -> list["flwr_app.Message"]:
    del arrays, config
    cfg = self.experiment.config
    self._tasks = protocol.round_tasks(self.groups, self._state, self.experiment.seed,
                                       server_round - 1, cfg.participation)
    messages = self._train_messages(grid, "train", server_round, cfg.local_epochs)
    self.bytes_per_round.append({"train_sent": sum(
        m.content["arrays"].count_bytes() for m in messages)})
    return messages

  def aggregate_train(self, server_round: int, replies: Iterable["flwr_app.Message"]
                      ) -> tuple[None, "flwr_app.MetricRecord"]:
    replies = list(replies)
    self._note_replies(replies, self._asked)
    uploads, losses, received = self._uploads(replies, self._tasks.clients)
    self._state, healthy = protocol.server_step(
        self.groups, self._state, self._tasks, uploads,
        outlier_factor=self.experiment.config.outlier_factor)
    took_part = np.zeros(self.num_clients, bool)
    took_part[self._tasks.clients] = True
    kept = [losses[i] for i in np.flatnonzero(healthy)]
    loss = float(np.sum(kept) / max(len(kept), 1))
    dropped = tuple(int(i) for i in np.flatnonzero(took_part & ~healthy))
    if took_part.any() and not healthy.any():
      raise RuntimeError(faults_lib.all_dropped(
          f"round {server_round} of {self.experiment.algorithm} seed "
          f"{self.experiment.seed} (Flower)", "no valid reply in time, "))
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
    held = self.groups.algorithm.evaluate(self._state)     # per group {kind: models}
    kinds, online = list(held[0]), set(grid.get_node_ids())
    self._asked = {i: node for i, node in self.nodes.items()
                   if node in online and i not in self._silent}
    messages = [flwr_app.Message(
        content=wire.packed(protocol.client_row(self.groups, held, i),
                            flwr_app.ConfigRecord({"client": i, "kinds": kinds})),
        dst_node_id=node, message_type=wire.EVALUATE, group_id=str(server_round))
                for i, node in self._asked.items()]
    self.bytes_per_round[-1]["evaluate_sent"] = sum(
        m.content["arrays"].count_bytes() for m in messages)
    return messages

  def aggregate_evaluate(self, server_round: int,
                         replies: Iterable["flwr_app.Message"]
                         ) -> "flwr_app.MetricRecord | None":
    if not self._due(server_round):
      return None
    kinds = tuple(self.groups.algorithm.evaluate(self._state)[0])
    correct = {kind: np.zeros(self.num_clients, np.int64) for kind in kinds}
    tests = np.zeros(self.num_clients, np.int64)
    waiting = set(range(self.num_clients))
    replies = list(replies)
    self._note_replies(replies, self._asked)
    for reply in replies:
      try:
        client, tested, counts = replies_lib.evaluation(reply, kinds, waiting,
                                                        self.nodes, self.tests)
      except Exception as e:  # pylint: disable=broad-except  # whatever a node sends
        LOG.warning("node %s: evaluation dropped: %s", reply.metadata.src_node_id,
                    replies_lib.reason(e))
        continue
      waiting.remove(client)
      tests[client] = tested
      for kind in kinds:
        correct[kind][client] = counts[kind]
    accuracies = {kind: records.Accuracy.of(c, tests) for kind, c in correct.items()}
    self.history[-1] = dataclasses.replace(
        self.history[-1], accuracies=accuracies,
        evaluated_clients=tuple(int(i) for i in np.flatnonzero(tests)))
    self._finish_round()
    return flwr_app.MetricRecord({f"{kind}_accuracy": a.accuracy
                                  for kind, a in accuracies.items()})

  def summary(self) -> None:
    LOG.info("pflax %s on %d clients, seed %d", self.experiment.algorithm,
             self.num_clients, self.experiment.seed)

  # The run's records.

  def run_record(self) -> records.RunRecord:
    """The run so far as `pflax.simulate.RunRecord`."""
    held = self.groups.algorithm.evaluate(self._state)
    seconds = time.perf_counter() - self._started if self._started else 0.0
    return records.RunRecord(algorithm=self.experiment.algorithm, seed=self.experiment.seed,
                             history=tuple(self.history), seconds=seconds,
                             output_norms=np.asarray(engine.client_output_norms(
                                 self.groups, held, self.parts.output)))

  def results(self) -> records.Results:
    """The run as the `results.json` of `pflax-run` (its `config` with a "flower"
    entry: Flower's version and the bytes per round)."""
    config = {**dataclasses.asdict(self.experiment.config),
              "algorithms": [self.experiment.algorithm], "seeds": [self.experiment.seed],
              "flower": {"version": flwr.__version__,
                         "bytes_per_round": self.bytes_per_round}}
    return records.Results(config, self.class_counts, (self.run_record(),))


def server_app(experiment: experiment_lib.Experiment | None = None,
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
    chosen = experiment or experiment_lib.Experiment.from_json(
        str(run_config["experiment"]))
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
