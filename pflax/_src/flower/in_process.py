"""A federation in one process, with real Flower messages and no network."""

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flwr import app as flwr_app
from flwr import serverapp as flwr_serverapp

from pflax._src.flower import client as client_lib
from pflax._src.flower import experiment as experiment_lib
from pflax._src.flower import server as server_lib


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
  app = app or client_lib.client_app()
  config = node_config or (lambda i: {"partition-id": i,
                                      "num-partitions": num_clients})
  return {i + 1: (app, flwr_app.Context(run_id=1, node_id=i + 1,
                                        node_config=config(i),
                                        state=flwr_app.RecordDict(), run_config={}))
          for i in range(num_clients)}


def _given(value: Any) -> Any:
  """A model or parts given in code (None for an import string, which travels)."""
  return None if isinstance(value, str) else value


def run_in_process(experiment: experiment_lib.Experiment,
                   grid: InProcessGrid | None = None) -> server_lib.PflaxStrategy:
  """Runs `experiment` through `PflaxStrategy` and `client_app()` in this process
  (`InProcessGrid`, default: one node per client, whose `client_app` is given
  the experiment's model and parts); returns the strategy, whose `results()`
  hold the run."""
  from flwr.supercore import task_identity  # pylint: disable=import-outside-toplevel
  identity = task_identity.TaskIdentity
  previous = (identity._run_id, identity._node_id, identity._task_id)  # pylint: disable=protected-access
  identity.run_id, identity.node_id, identity.task_id = 1, 0, 0
  try:
    grid = grid or InProcessGrid(in_process_nodes(
        experiment.config.clients, client_lib.client_app(model=_given(experiment.model),
                                                         parts=_given(experiment.parts))))
    strategy = server_lib.PflaxStrategy(experiment)
    strategy.start(grid, timeout=0.0)
    return strategy
  finally:
    identity.run_id, identity.node_id, identity.task_id = previous
