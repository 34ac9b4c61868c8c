"""Faults of nodes in a federation, in one process (`InProcessGrid`): a round in
which every participant is dropped stops the run; a node that does not reply to
a round's `train` message is not asked to evaluate in that round, and the
round's record names the clients its accuracies count; a node that lost its
registration (restarted), under its own node id or a new one, registers again
and trains. tests/test_flower_federation.py checks the same with real
processes."""

import numpy as np
import pytest

pytest.importorskip("flwr")

from pflax import flower  # pylint: disable=wrong-import-position
from pflax import simulate  # pylint: disable=wrong-import-position
from pflax._src.flower import client as client_lib  # pylint: disable=wrong-import-position

CONFIG = simulate.ExperimentConfig(clients=3, rounds=3, local_epochs=1)


def _round(message):
  return int(message.metadata.group_id or 0)


def test_a_round_in_which_every_participant_is_dropped_stops_the_run():
  lost = lambda message: message.metadata.message_type == "train" and _round(message) == 2
  grid = flower.InProcessGrid(flower.in_process_nodes(CONFIG.clients), lost=lost)
  with pytest.raises(RuntimeError) as error:
    flower.run_in_process(flower.Experiment("fedavg", CONFIG, 0), grid)
  message = str(error.value)
  assert "\n" not in message
  assert message.startswith("round 2 of fedavg seed 0 (Flower): every participant "
                            "was dropped (no valid reply in time")


def test_a_silent_node_is_not_asked_to_evaluate_and_the_record_says_so():
  """Client 1's node does not reply to round 2's train message: round 2 asks
  only the others to evaluate, its accuracies count clients 0 and 2 (as the
  record says), and client 1 is back in round 3."""
  asked = []
  app = flower.client_app()

  def counting(message, context):
    asked.append((_round(message), message.metadata.message_type,
                  flower.client_id(context)))
    return app(message, context)

  lost = lambda message: (message.metadata.message_type == "train"
                          and _round(message) == 2 and message.metadata.dst_node_id == 2)
  grid = flower.InProcessGrid(flower.in_process_nodes(CONFIG.clients, counting),
                              lost=lost)
  run = flower.run_in_process(flower.Experiment("fedavg", CONFIG, 0),
                              grid).results().runs[0]
  evaluated = lambda t: sorted(c for r, kind, c in asked if (r, kind) == (t, "evaluate"))
  assert [evaluated(t) for t in (1, 2, 3)] == [[0, 1, 2], [0, 2], [0, 1, 2]]
  assert [r.evaluated_clients for r in run.history] == [(0, 1, 2), (0, 2), (0, 1, 2)]
  assert [r.dropped_clients for r in run.history] == [(), (1,), ()]
  assert simulate.RoundRecord.from_json(run.history[1].to_json()) == run.history[1]


def _forgetting(client, before_round):
  """The ClientApp, except that `client`'s node forgets its state (a restarted
  SuperNode) just before round `before_round`'s train message."""
  app = flower.client_app()
  forgot = []

  def restarted(message, context):
    if (not forgot and flower.client_id(context) == client
        and message.metadata.message_type == "train"
        and _round(message) == before_round):
      forgot.append(True)
      del context.state[client_lib.EXPERIMENT]
    return app(message, context)
  return restarted


def test_a_restarted_node_registers_again_and_trains():
  """Client 1's node forgets its registration before round 2: its train message
  fails ("not registered"), so it is dropped from round 2 only; round 3 asks it
  to register again first, and it trains."""
  grid = flower.InProcessGrid(flower.in_process_nodes(CONFIG.clients,
                                                      _forgetting(1, 2)))
  strategy = flower.run_in_process(flower.Experiment("fedavg", CONFIG, 0), grid)
  history = strategy.results().runs[0].history
  assert [r.dropped_clients for r in history] == [(), (1,), ()]
  assert strategy.nodes == {0: 1, 1: 2, 2: 3}


class _Renumbered(flower.InProcessGrid):
  """A grid on which node 2 comes back as node 7 (a restarted node without a key
  of its own, with its state lost) after round `after`'s evaluation."""

  def __init__(self, nodes, after):
    super().__init__(nodes)
    self.after = after

  def push_messages(self, messages):
    messages = list(messages)
    if (2 in self.nodes and messages
        and messages[0].metadata.message_type == "evaluate"
        and _round(messages[0]) == self.after):
      ids = super().push_messages(messages)
      app, context = self.nodes.pop(2)
      del context.state[client_lib.EXPERIMENT]
      self.nodes[7] = (app, context)
      return ids
    return super().push_messages(messages)


def test_a_node_back_under_a_new_node_id_takes_over_its_client():
  grid = _Renumbered(flower.in_process_nodes(CONFIG.clients), after=1)
  strategy = flower.run_in_process(flower.Experiment("fedavg", CONFIG, 0), grid)
  history = strategy.results().runs[0].history
  assert [r.dropped_clients for r in history] == [(), (), ()]
  assert strategy.nodes == {0: 1, 1: 7, 2: 3}
  _same_accuracies(history, simulate.run("fedavg", CONFIG, 0).history)


def _same_accuracies(federated, simulated):
  for a, b in zip(federated, simulated, strict=True):
    assert a.accuracies == b.accuracies
    np.testing.assert_allclose(a.train_loss, b.train_loss, rtol=1e-5)
