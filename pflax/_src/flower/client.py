"""A node of a pflax federation: its Flower ClientApp and its data.

A node is one client (`node_config["partition-id"]`). It trains with the loss
and optimizer of its architecture group (`Groups.members`; client i of a
heterogeneous experiment uses architecture `i % G`) and tests with its
group's model. The optimizer state a client keeps between rounds (FedReMa's
momentum) stays in its `Context`.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flwr import app as flwr_app
from flwr import clientapp as flwr_clientapp

from pflax._src.data import federation as federation_lib
from pflax._src.flower import experiment as experiment_lib
from pflax._src.flower import wire
from pflax._src.simulation import engine
from pflax._src.simulation import experiment as simulation_experiment
from pflax._src.simulation import groups as groups_lib
from pflax._src.simulation import protocol

ClientDataFn = Callable[["flwr_app.Context", experiment_lib.Experiment],
                        federation_lib.ClientData]
"""`data(context, experiment) -> ClientData`: a client's own data."""

OPT_STATE = "pflax.opt_state"
EXPERIMENT = "pflax.experiment"


def client_id(context: "flwr_app.Context") -> int:
  """The client this node is: `node_config["partition-id"]`."""
  try:
    return int(context.node_config["partition-id"])
  except KeyError:
    raise ValueError("a pflax Flower node needs node_config partition-id (its client "
                     "id): flower-supernode --node-config 'partition-id=0'") from None


@functools.lru_cache(maxsize=4)
def _simulated_federation(experiment_json: str) -> federation_lib.Federation:
  experiment = experiment_lib.Experiment.from_json(experiment_json)
  return simulation_experiment.prepare(experiment.config, experiment.seed).federation


def simulated_partition(context: "flwr_app.Context",
                        experiment: experiment_lib.Experiment
                        ) -> federation_lib.ClientData:
  """The node's client of the simulated partition (`pflax.simulate.prepare` with
  the experiment's seed): client `partition-id`'s rows. Every node prepares the
  same partition and keeps its own part, as `pflax.simulate` splits the data."""
  client = client_id(context)
  federation = _simulated_federation(
      dataclasses.replace(experiment, model=None, parts=None).to_json())
  if not 0 <= client < federation.x.shape[0]:
    raise ValueError(f"partition-id must be in [0, {federation.x.shape[0]}), got "
                     f"{client}.")
  return federation.client(client)


def _templates(groups: groups_lib.Groups, client: int, input_shape: tuple[int, ...],
               num_classes: int) -> tuple[Any, Any, Any]:
  """Client `client`'s starting model, loss context and plain model (for shapes
  only: under `jax.eval_shape`)."""
  sample = np.zeros((1, *input_shape), np.float32)
  state = engine.initial_state(groups, sample,
                               np.zeros((groups.num_clients, num_classes), np.int32), 0)
  g, j = groups.position(client)
  row = lambda per_group: jax.tree.map(lambda x: x[j], per_group[g])
  context = groups.algorithm.client_context(state)
  return (row(groups.algorithm.client_models(state)),
          None if context[g] is None else row(context),
          groups.models[g].init(jax.random.key(0), sample)["params"])


class _Client:
  """A node's experiment: its group's algorithm and model, and its data (one per
  experiment)."""

  def __init__(self, experiment: experiment_lib.Experiment,
               data: federation_lib.ClientData, client: int,
               groups: Callable[[tuple[int, ...], int], groups_lib.Groups]):
    self.experiment, self.data, self.client = experiment, data, client
    self.input_shape = tuple(int(d) for d in data.x.shape[1:])
    groups = groups(self.input_shape, data.num_classes)
    g, _ = groups.position(client)
    self.member, self.model = groups.members[g], groups.models[g]
    shapes = jax.eval_shape(lambda: _templates(groups, client, self.input_shape,
                                               data.num_classes))
    self.start_like, self.context_like, self.model_like = shapes

  def summary(self) -> "flwr_app.MetricRecord":
    return flwr_app.MetricRecord({
        "client": self.client,
        "class-counts": self.data.class_counts().tolist(),
        "input-shape": list(self.input_shape),
        "tests": int(np.sum(self.data.test_mask))})


def client_app(data: ClientDataFn = simulated_partition, model: Any = None,
               parts: Any = None) -> "flwr_clientapp.ClientApp":
  """A Flower ClientApp training pflax's algorithms (see the module docstring).

  Args:
    data: the node's own data, `data(context, experiment) -> ClientData`
      (default: its client of the simulated partition).
    model, parts: the model and its `pflax.models.Parts` that the server's
      `Experiment` was given in code (objects do not travel: each node is
      given the same); None where the experiment names none or imports them
      (`"module:attr"`).
  """
  app = flwr_clientapp.ClientApp()
  clients: dict[tuple[str, int], _Client] = {}
  built: dict[tuple[str, tuple[int, ...], int], groups_lib.Groups] = {}

  def groups(text: str, input_shape: tuple[int, ...], num_classes: int
             ) -> groups_lib.Groups:
    """The experiment's `Groups`, once per experiment in this app, so that the
    clients of one process (in-process grids, Ray actors) share their compiled
    programs. (A dict, not `functools.lru_cache`: Flower's simulation engine
    pickles the app for its Ray actors, and a cached local function does not
    pickle.)"""
    key = (text, input_shape, num_classes)
    if key not in built:
      experiment = experiment_lib.Experiment.from_json(text, model, parts)
      built[key] = experiment.build(input_shape, num_classes)[0]
    return built[key]

  def experiment_client(context, text: str) -> _Client:
    key = (text, client_id(context))
    if key not in clients:
      experiment = experiment_lib.Experiment.from_json(text, model, parts)
      clients[key] = _Client(experiment, data(context, experiment), key[1],
                             functools.partial(groups, text))
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
    sent = wire.unpacked(message.content, {"model": client.start_like,
                                           "context": client.context_like},
                         "train message")
    params, context_ = sent["model"], sent["context"]
    member = client.member
    keeps = member.keep_opt_state and config["phase"] == "train"
    opt_state = None
    if keeps and OPT_STATE in context.state:
      like = jax.eval_shape(member.optimizer.init, params)
      opt_state = wire.from_record(context.state[OPT_STATE], like, "optimizer state")
    result = protocol.client_update(
        member, params, opt_state, context_, client.data,
        protocol.key_from_data(config["key"]), epochs=int(config["epochs"]),
        batch_size=int(config["batch-size"]))
    if keeps and protocol.finite(result.params):
      context.state[OPT_STATE] = wire.to_record(result.opt_state)
    return flwr_app.Message(wire.packed({"model": result.params}, flwr_app.MetricRecord({
        "client": client.client, "loss": float(result.loss),
        "num-examples": int(np.sum(client.data.mask))}), "metrics"), reply_to=message)

  @app.evaluate()
  def evaluate(message, context):
    client = current(context)
    kinds = [str(kind) for kind in message.content["config"]["kinds"]]
    held = wire.unpacked(message.content, {kind: client.model_like for kind in kinds},
                         "evaluate message")
    metrics = {"client": client.client, "tests": int(np.sum(client.data.test_mask))}
    for kind, params in held.items():
      metrics[f"correct-{kind}"] = protocol.correct_predictions(client.model, params,
                                                                client.data)
    return flwr_app.Message(flwr_app.RecordDict({
        "metrics": flwr_app.MetricRecord(metrics)}), reply_to=message)

  return app
