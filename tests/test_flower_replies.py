"""What a bad Flower node costs: each malformed reply drops only its client for
that round; a bad registration refuses the run with an error naming the client.

The strategy is driven in one process with hand-made replies (`_reply`). An
empty payload, a header of 10**12 elements, `client = inf`, `correct = inf` once
aborted the whole federation; class counts at registration were not checked."""

import copy
import io

import jax
import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr import app as flwr_app  # pylint: disable=wrong-import-position
from flwr.supercore import task_identity  # pylint: disable=wrong-import-position

from pflax import flower  # pylint: disable=wrong-import-position
from pflax import simulate  # pylint: disable=wrong-import-position
from pflax._src.flower import wire  # pylint: disable=wrong-import-position
from pflax._src.simulation import protocol  # pylint: disable=wrong-import-position
from pflax._src.simulation import records  # pylint: disable=wrong-import-position

CONFIG = simulate.ExperimentConfig(clients=4, rounds=1, local_epochs=1)
BAD = 2   # the client whose reply is malformed


@pytest.fixture
def message_identity(monkeypatch):
  """The identity a Flower message needs, as `run_in_process` sets it."""
  for name in ("_run_id", "_node_id", "_task_id"):
    monkeypatch.setattr(task_identity.TaskIdentity, name, 1)


def _npy(shape, descr="<f4", fortran=False, payload=b""):
  """`.npy` bytes whose header declares `shape` and `descr`, followed by `payload`."""
  stream = io.BytesIO()
  np.lib.format.write_array_header_1_0(stream, {"descr": descr, "shape": shape,
                                                "fortran_order": fortran})
  return stream.getvalue() + payload


def _raw(data, like):
  """A Flower Array of `like`'s declared dtype and shape holding the bytes `data`."""
  return flwr_app.Array(dtype=str(like.dtype), shape=tuple(like.shape),
                        stype="numpy.ndarray", data=data)


def _arrays(change):
  """A change of a reply's first array (a 2-D kernel)."""
  def changed(content):
    arrays = content["arrays"]
    key = next(k for k in arrays.keys() if len(arrays[k].shape) == 2)
    arrays[key] = change(arrays[key].numpy())
  return changed


def _metric(key, value):
  def changed(content):
    content["metrics"][key] = value
  return changed


def _reply(message, tree, metrics, change=None):
  """The reply to `message` holding `tree` and `metrics`, then `change`d."""
  content = wire.packed(tree, flwr_app.MetricRecord(metrics), "metrics")
  if change is not None:
    change(content)
  return flwr_app.Message(content, reply_to=message)


@pytest.fixture(scope="module")
def registered():
  """A registered strategy whose round 1 is configured (not yet aggregated)."""
  with pytest.MonkeyPatch.context() as patch:
    for name in ("_run_id", "_node_id", "_task_id"):
      patch.setattr(task_identity.TaskIdentity, name, 1)
    grid = flower.InProcessGrid(flower.in_process_nodes(4))
    s = flower.PflaxStrategy(flower.Experiment("fedavg", CONFIG, 0))
    s.register(grid, timeout=0.0)
    s.messages = s.configure_train(1, None, None, grid)
  s.grid = grid
  return s


@pytest.fixture
def strategy(registered, message_identity):  # pylint: disable=redefined-outer-name,unused-argument
  """`registered`, a copy of its own: aggregating a round changes the strategy."""
  s = copy.copy(registered)
  s.history = list(registered.history)
  s.bytes_per_round = [dict(b) for b in registered.bytes_per_round]
  return s


def _train_replies(strategy, change):  # pylint: disable=redefined-outer-name
  """Each participant's reply: its starting model back, loss 0.5; `BAD`'s changed."""
  replies = []
  for message in strategy.messages:
    client = int(message.content["config"]["client"])
    model = protocol.client_row(strategy.groups, strategy._tasks.starts, client)  # pylint: disable=protected-access
    replies.append(_reply(message, {"model": model}, {"client": client, "loss": 0.5},
                          change if client == BAD else None))
  return replies


TRAIN_ATTACKS = {
    "empty payload": _arrays(lambda a: _raw(b"", a)),
    "header of 10**12 elements": _arrays(lambda a: _raw(
        _npy((10**12,), payload=b"\0" * 64), a)),
    "header of the right shape, short payload": _arrays(lambda a: _raw(
        _npy(a.shape, payload=b"\0" * 4), a)),
    "header of the right shape, long payload": _arrays(lambda a: _raw(
        _npy(a.shape, payload=b"\0" * (a.nbytes + 4)), a)),
    "object dtype (a pickle)": _arrays(lambda a: _raw(_npy(a.shape, "|O"), a)),
    "big-endian": _arrays(lambda a: flwr_app.Array(a.astype(">f4"))),
    "Fortran order": _arrays(lambda a: flwr_app.Array(np.asfortranarray(a))),
    "wrong shape": _arrays(lambda a: flwr_app.Array(a[:1])),
    "wrong dtype": _arrays(lambda a: flwr_app.Array(a.astype(np.float64))),
    "not numpy": _arrays(lambda a: flwr_app.Array(
        dtype="float32", shape=a.shape, stype="torch.tensor", data=a.tobytes())),
    "client = inf": _metric("client", float("inf")),
    "client = 10**18": _metric("client", 10**18),
    "client = -1": _metric("client", -1),
    "client = 2.0": _metric("client", 2.0),
    "another participant's id": _metric("client", 0),
    "loss = nan": _metric("loss", float("nan")),
    "loss = inf": _metric("loss", float("inf")),
    "loss = 1e30": _metric("loss", 1e30),
    "loss = -1e30": _metric("loss", -1e30),
    "no loss": lambda content: content["metrics"].pop("loss"),
    "no arrays": lambda content: content.pop("arrays"),
}


@pytest.mark.parametrize("attack", TRAIN_ATTACKS)
def test_a_malformed_upload_drops_only_its_client(strategy, attack, caplog):  # pylint: disable=redefined-outer-name
  clients = {int(m.content["config"]["client"]) for m in strategy.messages}
  assert BAD in clients and len(clients) == 4
  _, metrics = strategy.aggregate_train(1, _train_replies(strategy,
                                                          TRAIN_ATTACKS[attack]))
  assert strategy.history[-1].dropped_clients == (BAD,)
  assert (metrics["aggregated"], metrics["dropped"]) == (3, 1)
  assert strategy.history[-1].train_loss == 0.5
  assert f"node {BAD + 1}: reply dropped" in caplog.text


def test_a_reply_naming_another_nodes_client_is_dropped_even_when_first(strategy):  # pylint: disable=redefined-outer-name
  """A node's reply counts only for the client it was asked to train: `BAD`'s
  node, replying first in the name of client 0 with a model of its own, is
  dropped, and client 0's own reply is the one aggregated."""
  replies = _train_replies(strategy, None)
  bad = next(i for i, r in enumerate(replies) if r.metadata.src_node_id == BAD + 1)
  honest = next(i for i, r in enumerate(replies) if r.metadata.src_node_id == 1)
  forged_model = jax.tree.map(lambda a: np.full_like(a, 7.0), protocol.client_row(
      strategy.groups, strategy._tasks.starts, 0))  # pylint: disable=protected-access
  forged = _reply(strategy.messages[bad], {"model": forged_model},
                  {"client": 0, "loss": 0.9})
  rest = [r for i, r in enumerate(replies) if i not in (bad, honest)]
  uploads, losses, _ = strategy._uploads([forged, replies[honest]] + rest, range(4))  # pylint: disable=protected-access
  assert sorted(uploads) == sorted(set(range(4)) - {BAD}) and losses[0] == 0.5
  assert not any(np.any(np.asarray(leaf) == 7.0)
                 for leaf in jax.tree.leaves(uploads[0]))


def test_an_error_reply_or_a_reply_twice_costs_only_that_client(strategy):  # pylint: disable=redefined-outer-name
  replies = _train_replies(strategy, None)
  bad = next(i for i, r in enumerate(replies) if r.metadata.src_node_id == BAD + 1)
  replies[bad] = flwr_app.Message(flwr_app.Error(0, "crashed"),
                                  reply_to=strategy.messages[bad])
  replies.append(replies[0])                  # client 0 answers twice: counted once
  uploads, _, _ = strategy._uploads(replies, range(4))  # pylint: disable=protected-access
  assert sorted(uploads) == [0, 1, 3]


def test_a_reply_naming_another_nodes_client_is_dropped_even_first(strategy, caplog):  # pylint: disable=redefined-outer-name
  """A node's reply counts only for the client that node was asked to train:
  `BAD`'s node naming client `BAD + 1`, whose reply has not arrived yet (so that
  client is still awaited), is dropped, and that client's own reply counts."""
  replies = _train_replies(strategy, _metric("client", BAD + 1))
  first = next(i for i, r in enumerate(replies) if r.metadata.src_node_id == BAD + 1)
  replies.insert(0, replies.pop(first))
  _, metrics = strategy.aggregate_train(1, replies)
  assert strategy.history[-1].dropped_clients == (BAD,)
  assert (metrics["aggregated"], metrics["dropped"]) == (3, 1)
  assert f"node {BAD + 1}: reply dropped" in caplog.text
  assert f"node {BAD + 2}: reply dropped" not in caplog.text


def test_a_reply_whose_data_declares_10_12_elements_allocates_nothing(monkeypatch):
  """The size is refused from the header: no allocation, no `np.load`."""
  def refuse(*args, **kwargs):
    raise AssertionError("np.load was called")
  monkeypatch.setattr(np, "load", refuse)
  like = np.zeros(3, np.float32)
  with pytest.raises(ValueError, match=r"must be float32\(3,\), got float32\(10+,\)"):
    flower.from_record(flwr_app.ArrayRecord({"['w']": _raw(_npy((10**12,)), like)}),
                       {"w": like}, "model")
  back = flower.from_record(flower.to_record({"w": like + 1}), {"w": like})
  np.testing.assert_array_equal(back["w"], like + 1)
  assert back["w"].flags.writeable


def _evaluate(strategy, change=None, lie=None):  # pylint: disable=redefined-outer-name
  """Aggregates round 1's evaluation in which every client reports half its test
  samples correct, `BAD`'s reply `change`d or its metrics updated with `lie`."""
  strategy.aggregate_train(1, _train_replies(strategy, None))
  messages = strategy.configure_evaluate(1, None, None, strategy.grid)
  kinds = list(strategy.groups.algorithm.evaluate(strategy._state)[0])  # pylint: disable=protected-access
  replies = []
  for message in messages:
    client = int(message.content["config"]["client"])
    tests = int(strategy.tests[client])
    metrics = {"client": client, "tests": tests,
               **{f"correct-{kind}": tests // 2 for kind in kinds}}
    if client == BAD:
      metrics.update(lie or {})
    content = flwr_app.RecordDict({"metrics": flwr_app.MetricRecord(metrics)})
    replies.append(flwr_app.Message(content, reply_to=message))
    if client == BAD and change:
      change(replies[-1].content)
  strategy.aggregate_evaluate(1, replies)
  return strategy.history[-1].accuracies, kinds


def _without_bad(strategy):  # pylint: disable=redefined-outer-name
  tests = strategy.tests.copy()
  tests[BAD] = 0
  return records.Accuracy.of(tests // 2, tests)


@pytest.mark.parametrize("lie", [
    {"correct-personalized": float("inf")},
    {"correct-personalized": 2**63 - 1},
    {"correct-personalized": -1},
    {"correct-personalized": 1.0},
    {"tests": 1},                                         # correct > tests
    {"tests": 10**6},                                     # tests > registered
    {"tests": 10**9, "correct-personalized": 10**9, "correct-global": 10**9},
    {"tests": 1e9, "correct-personalized": 1e9, "correct-global": 1e9},
    {"client": float("inf")},
    {"client": 0},                                        # another client's evaluation
], ids=str)
def test_a_malformed_evaluation_leaves_only_its_client_out(strategy, lie):  # pylint: disable=redefined-outer-name
  accuracies, kinds = _evaluate(strategy, lie=lie)
  assert set(kinds) == {"personalized", "global"}
  for kind in kinds:
    assert accuracies[kind] == _without_bad(strategy)
    assert accuracies[kind].accuracy < 0.6          # the 1e9 lie made it 1.0


def test_an_evaluation_without_a_kind_is_left_out(strategy):  # pylint: disable=redefined-outer-name
  accuracies, _ = _evaluate(strategy, change=lambda c: c["metrics"].pop(
      "correct-global"))
  assert accuracies["global"] == accuracies["personalized"] == _without_bad(strategy)


def test_an_honest_evaluation_of_fewer_samples_counts_as_reported(strategy):  # pylint: disable=redefined-outer-name
  accuracies, _ = _evaluate(strategy, lie={"tests": 2, "correct-personalized": 1,
                                           "correct-global": 1})
  tests = strategy.tests.copy()
  correct = tests // 2
  tests[BAD], correct[BAD] = 2, 1
  assert accuracies["personalized"] == records.Accuracy.of(correct, tests)


# Registration.

def _registering(change):
  """The ClientApp, except that client `BAD`'s registration summary is `change`d."""
  app = flower.client_app()

  def changed(message, context):
    reply = app(message, context)
    if flower.client_id(context) == BAD and message.metadata.message_type == "query":
      change(reply.content["summary"])
    return reply
  return changed


def _set(key, value):
  return lambda summary: summary.__setitem__(key, value)


def _counts(change):
  return lambda summary: summary.__setitem__(
      "class-counts", change(list(summary["class-counts"])))


@pytest.mark.usefixtures("message_identity")
@pytest.mark.parametrize("change, match", [
    (_counts(lambda c: [-5] + c[1:]), r"class-counts\[0\] must be an integer in \[0, "),
    (_counts(lambda c: [2**31] + c[1:]), r"class-counts\[0\] must be an integer"),
    (_counts(lambda c: [float(n) for n in c]), r"class-counts\[0\] must be an integer"),
    (_counts(lambda c: [float("inf")] * len(c)), r"class-counts\[0\] must be"),
    (_counts(lambda c: c[1:]), "client 2 registered 9 classes, most clients 10 classes"),
    (_counts(lambda c: [2 * 10**9] * len(c)), r"sum to \d+, more than 2147483647 .* "
                                              "client 2 registered"),
    (_set("class-counts", 7), "class-counts must be a non-empty list"),
    (_set("input-shape", [8, 9]), r"client 2 registered inputs of shape \(8, 9\)"),
    (_set("input-shape", [0]), "input-shape must be positive"),
    (_set("tests", -1), "client 2's tests must be an integer"),
    (_set("tests", float("inf")), "client 2's tests must be an integer"),
    (_set("tests", 1e9), "client 2's tests must be an integer"),
    (_set("client", float("inf")), "partition-id"),
    (lambda summary: summary.pop("tests"), "KeyError"),
])
def test_an_invalid_registration_refuses_the_run_naming_the_client(change, match):
  nodes = flower.in_process_nodes(4, _registering(change))
  strategy = flower.PflaxStrategy(flower.Experiment("cwfedavg", CONFIG, 0))
  with pytest.raises(RuntimeError, match=match) as error:
    strategy.register(flower.InProcessGrid(nodes), timeout=0.0)
  assert "\n" not in str(error.value)
  assert "node 3" in str(error.value) or "client 2" in str(error.value)


def test_a_federation_completes_when_a_client_sends_a_huge_header():
  """End to end: the run completes with that client dropped, the others trained
  and evaluated as usual."""
  app = flower.client_app()

  def huge(message, context):
    reply = app(message, context)
    if flower.client_id(context) == 1 and message.metadata.message_type == "train":
      _arrays(lambda a: _raw(_npy((10**12,)), a))(reply.content)
    return reply

  grid = flower.InProcessGrid(flower.in_process_nodes(4, huge))
  run = flower.run_in_process(flower.Experiment("fedavg", CONFIG, 0),
                                  grid).results().runs[0]
  assert [h.dropped_clients for h in run.history] == [(1,)]
  assert run.history[0].accuracies["personalized"].accuracy > 0.3
  assert all(np.isfinite(h.train_loss) for h in run.history)
  assert np.all(np.isfinite(run.output_norms))
