"""What a dishonest node of a real Flower federation costs (slow): each
malformed reply, sent by a real SuperNode's ClientApp process, drops only its
client from that round.

One deployment of `LocalFederation` (TLS, SuperNode authentication, a SuperNode
process per client) in which node `BAD` alone runs modified code: its processes
(`node_env`: its SuperNode, its SuperExec and the ClientApp processes they
start) have on their `PYTHONPATH` a `sitecustomize` (`DISHONEST`) that wraps
`pflax._src.flower.client.client_app`, as a participant could, so that its reply to
some messages is malformed (`ATTACKS`: one `train` and one `evaluate` reply in
each of rounds 1 to 3; round 4 is honest). One run (`outcome`), about 2 minutes
on 2 CPU cores, is checked by every test: it completes, each malformed reply is
dropped for its own reason, and every round equals the in-process run in which
those replies never arrived (the other clients, and the dishonest client's
honest replies, count as without the attack); nothing of the federation is left
running afterwards. `tests/test_flower_replies.py` drives the server's checks
in one process.
"""

import dataclasses
import io
import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

pytest.importorskip("flwr")

from pflax import flower  # pylint: disable=wrong-import-position
from pflax import simulate  # pylint: disable=wrong-import-position
from pflax._src.flower import guard as flower_guard  # pylint: disable=wrong-import-position
import processes  # pylint: disable=wrong-import-position
from pflax._src.simulation import records  # pylint: disable=wrong-import-position

# One deployment with a dishonest node (minutes on 2 cores): run by hand (-m extended);
# the same replies are refused in one process by tests/test_flower_replies.py.
pytestmark = [pytest.mark.slow, pytest.mark.extended,
              pytest.mark.xdist_group("flower_node_replies")]

CONFIG = simulate.ExperimentConfig(clients=3, rounds=4, local_epochs=1)
ALGORITHM = "fedavg"   # evaluates two kinds: personalized and global
BAD = 1                # the dishonest node's partition-id (its client)
TRAIN, EVALUATE = "train", "evaluate"

DISHONEST = '''\
"""A dishonest pflax node: in its ClientApp processes (`flwr-clientapp`),
`pflax._src.flower.client.client_app` makes an app whose reply to each message that
attacks.json (beside this file) names, by type and round, is changed. Each
reply is noted in replies.txt: "TYPE ROUND PARTITION-ID changed|honest"."""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _change(content, attack):
  """Replaces the bytes of the reply's first 2-D array, and updates its metrics."""
  from flwr import app as flwr_app
  if attack["kernel"] is not None:
    arrays = content["arrays"]
    key = next(k for k in arrays.keys() if len(arrays[k].shape) == 2)
    array = arrays[key]
    arrays[key] = flwr_app.Array(dtype=array.dtype, shape=array.shape,
                                 stype=array.stype,
                                 data=bytes.fromhex(attack["kernel"]))
  for key, value in attack["metrics"].items():
    content["metrics"][key] = value


def _install():
  from flwr import clientapp as flwr_clientapp
  from pflax._src.flower import client as flower
  with open(os.path.join(HERE, "attacks.json"), encoding="utf-8") as f:
    attacks = {(a["message"], str(a["round"])): a for a in json.load(f)}
  honest_client_app = flower.client_app

  def dishonest_client_app(*args, **kwargs):
    honest = honest_client_app(*args, **kwargs)
    app = flwr_clientapp.ClientApp()

    def reply(message, context):
      answer = honest(message, context)
      kind, group = message.metadata.message_type, message.metadata.group_id
      attack = attacks.get((kind, group))
      if attack is not None:
        _change(answer.content, attack)
      with open(os.path.join(HERE, "replies.txt"), "a", encoding="utf-8") as f:
        f.write(f"{kind} {group or '-'} {context.node_config['partition-id']} "
                f"{'honest' if attack is None else 'changed'}\\n")
      return answer

    for register in (app.query, app.train, app.evaluate):
      register()(reply)
    return app

  flower.client_app = dishonest_client_app


if os.path.basename(sys.argv[0]) == "flwr-clientapp":
  _install()
'''


@dataclasses.dataclass(frozen=True)
class Attack:
  """Node `BAD`'s reply to its `message` of round `round`, with the bytes of its
  first 2-D array replaced by `kernel` (None: kept) and its metrics updated with
  `metrics`; the server drops it for a reason matching `reason`."""
  message: str
  round: int
  reason: str
  kernel: bytes | None = None
  metrics: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def to_json(self) -> dict[str, Any]:
    return {"message": self.message, "round": self.round, "metrics": dict(self.metrics),
            "kernel": None if self.kernel is None else self.kernel.hex()}


def _npy(shape: tuple[int, ...], payload: bytes = b"") -> bytes:
  """`.npy` bytes whose header declares float32 `shape`, followed by `payload`."""
  stream = io.BytesIO()
  np.lib.format.write_array_header_1_0(stream, {"descr": "<f4", "shape": shape,
                                                "fortran_order": False})
  return stream.getvalue() + payload


_TESTS_LIE = (rf"client {BAD}'s tests \(registered: \d+\) must be an integer "
              r"in \[0, \d+\]")
ATTACKS = {
    "empty array": Attack(TRAIN, 1, r"is not \.npy bytes", kernel=b""),
    "header of 10**12 elements": Attack(
        TRAIN, 2, r"must be float32\([\d, ]+\), got float32\(1000000000000,\)",
        kernel=_npy((10**12,), bytes(64))),
    "client = inf": Attack(TRAIN, 3, r"client must be an integer in \[0, 2\], got inf",
                           metrics={"client": math.inf}),
    "correct = inf": Attack(
        EVALUATE, 1, r"client 1's correct-personalized must be an integer .*got inf",
        metrics={"correct-personalized": math.inf}),
    "tests = correct = 1e9": Attack(
        EVALUATE, 2, _TESTS_LIE + r", got 1000000000\.0\.",
        metrics={"tests": 1e9, "correct-personalized": 1e9, "correct-global": 1e9}),
    "tests = correct = 10**9": Attack(
        EVALUATE, 3, _TESTS_LIE + r", got 1000000000\.(?!\d)",
        metrics={"tests": 10**9, "correct-personalized": 10**9,
                 "correct-global": 10**9}),
}


# The federation's processes (Linux /proc), as tests/test_flower_security.py finds them.


def _stat(pid: int) -> list[str]:
  """`[state, ppid, ...]` of `/proc/PID/stat` ([] for a process gone)."""
  try:
    with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
      return f.read().rsplit(")", 1)[1].split()
  except (OSError, IndexError):
    return []


def _alive(token: str) -> set[int]:
  """The processes of the federation marked `token`, zombies excluded."""
  return {pid for pid in processes.pids()
          if processes.environment(pid).get(flower_guard.VARIABLE) == token
          and _stat(pid)[:1] not in ([], ["Z"])}


def _tree(pid: int) -> set[int]:
  """`pid` and the processes it started, recursively."""
  children: dict[int, list[int]] = {}
  for child in processes.pids():
    stat = _stat(child)
    if len(stat) > 1:
      children.setdefault(int(stat[1]), []).append(child)
  found, todo = {pid}, [pid]
  while todo:
    for child in children.get(todo.pop(), []):
      found.add(child)
      todo.append(child)
  return found


@dataclasses.dataclass(frozen=True)
class Outcome:
  """The federated run with the dishonest node, and what is known of it.

  Attributes:
    run: the run as `LocalFederation.run` returns it; `saved`: its results.json.
    log: the run's log (`flwr run --stream`: the ServerApp's warnings).
    replies: what the dishonest code noted, `[type, round, client, changed]`.
    modified, bad_node: the federation's processes (after the run) whose
      PYTHONPATH holds the dishonest code, and those of SuperNode `BAD`.
    left: the federation's processes alive once it is closed.
  """
  run: records.RunRecord
  saved: records.RunRecord
  log: str
  replies: list[list[str]]
  modified: set[int]
  bad_node: set[int]
  left: set[int]


def _dishonest_folder(folder: str) -> str:
  """Writes the dishonest node's `sitecustomize.py` and `attacks.json` in `folder`."""
  with open(os.path.join(folder, "sitecustomize.py"), "w", encoding="utf-8") as f:
    f.write(DISHONEST)
  with open(os.path.join(folder, "attacks.json"), "w", encoding="utf-8") as f:
    json.dump([a.to_json() for a in ATTACKS.values()], f)
  return folder


def _read(path: str) -> str:
  with open(path, encoding="utf-8", errors="replace") as f:
    return f.read()


@pytest.fixture(scope="module")
def outcome(tmp_path_factory) -> Outcome:
  """Runs `CONFIG` in a deployment whose node `BAD` sends `ATTACKS`, notes which
  of its processes run the dishonest code, then closes it."""
  folder = _dishonest_folder(str(tmp_path_factory.mktemp("dishonest")))
  logs, out = (str(tmp_path_factory.mktemp(name)) for name in ("logs", "out"))
  path = os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH")) if p)
  federation = flower.LocalFederation(CONFIG.clients, log_dir=logs,
                                      node_env={BAD: {"PYTHONPATH": path}})
  token = federation.env[flower_guard.VARIABLE]
  with federation:
    run = federation.run(flower.Experiment(ALGORITHM, CONFIG, 0), out,
                         timeout=120.0).runs[0]
    alive = _alive(token)
    modified = {p for p in alive
                if folder in processes.environment(p).get("PYTHONPATH", "").split(os.pathsep)}
    bad_node = _tree(federation.supernodes[BAD].pid) & alive
  log = _read(os.path.join(logs, f"run-1-{ALGORITHM}.log"))
  replies = [line.split() for line in _read(os.path.join(folder, "replies.txt"))
             .splitlines()]
  saved = records.Results.load(os.path.join(out, "results.json")).runs[0]
  return Outcome(run, saved, log, replies, modified, bad_node, _alive(token))


@pytest.fixture(scope="module")
def without_those_replies() -> records.RunRecord:
  """The run in process in which node `BAD`'s attacked replies never arrive."""
  attacked = {(a.message, str(a.round)) for a in ATTACKS.values()}

  def lost(message: Any) -> bool:
    return message.metadata.dst_node_id == BAD + 1 and (
        message.metadata.message_type, message.metadata.group_id) in attacked

  grid = flower.InProcessGrid(flower.in_process_nodes(CONFIG.clients), lost=lost)
  return flower.run_in_process(flower.Experiment(ALGORITHM, CONFIG, 0),
                               grid).results().runs[0]


def _same_round(a: records.RoundRecord, b: records.RoundRecord) -> None:
  """The same accuracies and dropped clients, the training loss to float
  rounding (as `tests/test_flower_federation.py` compares)."""
  assert (a.round, a.accuracies, a.dropped_clients) == (
      b.round, b.accuracies, b.dropped_clients)
  np.testing.assert_allclose(a.train_loss, b.train_loss, rtol=1e-5)


@pytest.mark.parametrize("name", ATTACKS)
def test_a_malformed_reply_of_a_real_node_drops_only_its_client(
    outcome, without_those_replies, name):  # pylint: disable=redefined-outer-name
  """Node `BAD`'s ClientApp sent it, the server dropped it for its reason, and
  the round is the round without that reply: for a `train` reply only `BAD` is
  dropped, for an `evaluate` reply only `BAD` is left out of the accuracy."""
  attack = ATTACKS[name]
  assert [attack.message, str(attack.round), str(BAD), "changed"] in outcome.replies
  what = "reply" if attack.message == TRAIN else "evaluation"
  found = re.findall(rf"node \d+: {what} dropped: \w+: .*{attack.reason}", outcome.log)
  assert len(found) == 1, (found, outcome.log[-4000:])
  record = outcome.run.history[attack.round - 1]
  assert record.dropped_clients == (BAD,)     # round 1 to 3 all drop its upload
  _same_round(record, without_those_replies.history[attack.round - 1])


def test_the_run_completes_as_without_those_replies(outcome, without_those_replies):  # pylint: disable=redefined-outer-name
  """Every round of the run and of its results.json: `BAD` dropped from rounds
  1 to 3 and back in round 4, the accuracies those of the other clients'
  evaluations (and `BAD`'s honest ones), finite losses and models."""
  history = outcome.run.history
  assert [h.dropped_clients for h in history] == [(BAD,)] * 3 + [()]
  assert outcome.saved.history == history
  for record, expected in zip(history, without_those_replies.history, strict=True):
    _same_round(record, expected)
    assert np.isfinite(record.train_loss)
    assert all(0.0 < a.accuracy <= 1.0 for a in record.accuracies.values())
  assert history[-1].accuracies["personalized"].accuracy > 0.5
  assert len(re.findall(r"node \d+: (reply|evaluation) dropped", outcome.log)) == 6
  assert np.all(np.isfinite(outcome.run.output_norms))


def test_only_the_dishonest_node_runs_other_code(outcome):  # pylint: disable=redefined-outer-name
  """The dishonest `PYTHONPATH` is in node `BAD`'s SuperNode and SuperExec only,
  and only node `BAD`'s ClientApps ran the dishonest code (every message it got:
  the query, 4 train, 4 evaluate)."""
  assert len(outcome.bad_node) >= 2          # the SuperNode and its SuperExec
  assert outcome.modified == outcome.bad_node
  assert {r[2] for r in outcome.replies} == {str(BAD)}
  assert len(outcome.replies) == 1 + 2 * CONFIG.rounds
  assert sum(r[3] == "changed" for r in outcome.replies) == len(ATTACKS)


def test_no_flower_process_is_left(outcome):  # pylint: disable=redefined-outer-name
  assert not outcome.left
