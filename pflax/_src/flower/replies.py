"""What a node sends, checked: nothing a node sends is trusted.

Every number is checked: counts are integers in `[0, MAX_COUNT]`, a loss is
finite and at most `faults.MAX_LOSS` in magnitude, an evaluation has `correct <=
tests <=` the test samples its client registered, a reply comes from the node of a client the server waits for. A
`train` or `evaluate` reply that fails any check, or fails to decode in any
way (`pflax._src.flower.wire`), drops its client from that round and nobody
else. A registration that fails a check (class counts that are negative, too
large or of another K than the other clients', the federation's counts summing
past `MAX_COUNT`, another input shape) refuses the run before round 1 with an
error naming the node and client: the initial state needs every client's class
counts.
"""

import collections
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from pflax._src.flower import wire
from pflax._src.simulation import faults as faults_lib

MAX_COUNT = 2**31 - 1
"""The largest count a node may declare, and the largest sum of the federation's
training class counts: the algorithms add class counts in int32."""


def count(value: Any, name: str, most: int = MAX_COUNT) -> int:
  """`value` as an int in `[0, most]`; ValueError naming `name` for anything else
  (a float, a bool, inf, a negative or larger number)."""
  if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))
      or not 0 <= value <= most):
    raise ValueError(f"{name} must be an integer in [0, {most}], got {value!r}.")
  return int(value)


def finite_number(value: Any, name: str) -> float:
  """`value`, a float, if it is finite; ValueError naming `name` for anything else."""
  if not isinstance(value, (float, np.floating)) or not math.isfinite(value):
    raise ValueError(f"{name} must be a finite number, got {value!r}.")
  return float(value)


def training_loss(value: Any, name: str) -> float:
  """A reported training loss: a finite number of magnitude at most
  `faults.MAX_LOSS`, the engine's health rule (`faults.plausible_losses`);
  ValueError naming `name` for anything else."""
  loss = finite_number(value, name)
  if abs(loss) > faults_lib.MAX_LOSS:
    raise ValueError(f"{name} must be at most {faults_lib.MAX_LOSS:g} in magnitude, "
                     f"got {value!r}.")
  return loss


def reason(error: Exception) -> str:
  """An error as a log line's reason."""
  return f"{type(error).__name__}: {error}"


class Registration(NamedTuple):
  """What a node declares once, at registration (`registration` checks it)."""
  class_counts: tuple[int, ...]
  input_shape: tuple[int, ...]
  tests: int


def registration(summary: Mapping[str, Any], num_clients: int
                 ) -> tuple[int, Registration]:
  """`(client, registration)` of a `query` reply's summary.

  Raises:
    ValueError: for a client id outside `[0, num_clients)`, class counts that
      are not a non-empty list of integers in `[0, MAX_COUNT]`, an input shape
      that is not a non-empty list of positive integers, a test count that is
      not an integer in `[0, MAX_COUNT]`.
  """
  client = count(summary["client"], "client (the node's partition-id)",
                 num_clients - 1)
  counts, shape = summary["class-counts"], summary["input-shape"]
  if not isinstance(counts, list) or not counts:
    raise ValueError(f"client {client}'s class-counts must be a non-empty list of "
                     f"integers, got {counts!r}.")
  if not isinstance(shape, list) or not shape:
    raise ValueError(f"client {client}'s input-shape must be a non-empty list of "
                     f"integers, got {shape!r}.")
  counts = tuple(count(c, f"client {client}'s class-counts[{j}]")
                 for j, c in enumerate(counts))
  shape = tuple(count(d, f"client {client}'s input-shape[{j}]") for j, d in
                enumerate(shape))
  if min(shape) < 1:
    raise ValueError(f"client {client}'s input-shape must be positive, got {shape}.")
  return client, Registration(counts, shape, count(summary["tests"],
                                                   f"client {client}'s tests"))


def agreed(values: Mapping[int, Any], what: str) -> Any:
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


def replying_client(reply: "wire.flwr_app.Message", waiting: set[int],
                    nodes: Mapping[int, int], what: str) -> tuple[Any, int]:
  """`(metrics, client)` of a reply from the node of a client of `waiting`.

  Args:
    reply: a node's reply.
    waiting: the clients whose reply the server waits for.
    nodes: `{client: node id}` of every registered client.
    what: what the reply is, for the error ("a reply for").

  Raises:
    ValueError: the node failed, or replied for a client it was not asked for
      (or one answered already).
  """
  if reply.has_error():
    raise ValueError(f"the node failed: {reply.error.reason}")
  metrics = reply.content["metrics"]
  client = count(metrics["client"], "client", len(nodes) - 1)
  if client not in waiting or nodes[client] != reply.metadata.src_node_id:
    raise ValueError(f"{what} client {client}, which this node was not asked for "
                     "(or that was answered already)")
  return metrics, client


def evaluation(reply: "wire.flwr_app.Message", kinds: tuple[str, ...],
               waiting: set[int], nodes: Mapping[int, int], registered: np.ndarray
               ) -> tuple[int, int, dict[str, int]]:
  """`(client, tests, {kind: correct})` of an `evaluate` reply: from the node of
  a client of `waiting`, with `correct <= tests <=` the test samples that client
  registered (`registered[client]`), all integers.

  Raises:
    ValueError: for any other reply.
  """
  m, client = replying_client(reply, waiting, nodes, "an evaluation of")
  tests = count(m["tests"], f"client {client}'s tests (registered: "
                f"{registered[client]})", int(registered[client]))
  return client, tests, {kind: count(m[f"correct-{kind}"],
                                     f"client {client}'s correct-{kind}", tests)
                         for kind in kinds}
