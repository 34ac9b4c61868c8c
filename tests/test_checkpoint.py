"""Checkpoints: what a restored checkpoint must hold, and when one is read at all.

A real checkpoint of a tiny sweep is tampered with field by field (read and
written with `flax.serialization`, as pflax writes it); every inconsistency is
one clear error naming the file, raised before any round runs.
"""

import json
import re
import shutil

import numpy as np
import pytest
from flax import serialization
from flax import traverse_util

from pflax import simulate

CONFIG = simulate.ExperimentConfig(clients=4, rounds=2, model="mlp", local_epochs=1)
NAME = "fedavg-seed0.ckpt"


@pytest.fixture(scope="module")
def setup():
  return simulate.prepare(CONFIG, 0)


@pytest.fixture(scope="module")
def complete(setup, tmp_path_factory):
  """`(checkpoint at the last round, the run that wrote it)`."""
  directory = tmp_path_factory.mktemp("complete")
  run = simulate.run("fedavg", CONFIG, 0, setup=setup, checkpoint_dir=str(directory),
                     checkpoint_every=1)
  return directory / NAME, run


def _without_time(run):
  return {k: v for k, v in run.to_json().items() if k != "seconds"}


def _resume(setup, directory, on_round=None):
  return simulate.run("fedavg", CONFIG, 0, setup=setup, checkpoint_dir=str(directory),
                      resume=True, on_round=on_round)


def test_a_complete_checkpoint_resumes_without_running_a_round(setup, complete):
  path, run = complete
  rounds = []
  resumed = _resume(setup, path.parent, lambda record: rounds.append(record.round))
  assert rounds == []
  assert _without_time(resumed) == _without_time(run)


def _history(change):
  def tamper(payload):
    payload["history"] = json.dumps(change(json.loads(payload["history"])))
  return tamper


def _first_float_leaf(change):
  def tamper(payload):
    flat = traverse_util.flatten_dict(payload["carry"], keep_empty_nodes=True)
    key = next(k for k, v in flat.items()
               if isinstance(v, np.ndarray) and v.dtype == np.float32)
    flat[key] = change(flat[key])
    payload["carry"] = traverse_util.unflatten_dict(flat)
  return tamper


def _leaf(field, change):
  def tamper(payload):
    flat = traverse_util.flatten_dict(payload["carry"], keep_empty_nodes=True)
    key = next(k for k in flat if field in k)
    flat[key] = change(flat[key])
    payload["carry"] = traverse_util.unflatten_dict(flat)
  return tamper


def _record(field, value):
  def change(histories):
    histories[0][0][field] = value
    return histories
  return _history(change)


def _set(field, value):
  return lambda payload: payload.__setitem__(field, value)


def _nan_at_0(x):
  x = x.copy()
  x.flat[0] = np.nan
  return x


TAMPERED = {
    "round_below_0": (_set("round", -5), r"round -5 is outside \[0, 2\]"),
    "round_beyond_rounds": (_set("round", 99), r"round 99 is outside \[0, 2\]"),
    "round_not_integer": (_set("round", 1.5), r"round 1.5 is not an integer"),
    "round_text": (_set("round", "2"), r"round '2' is not an integer"),
    "seconds_nan": (_set("seconds", float("nan")), r"seconds nan is not a finite"),
    "seconds_negative": (_set("seconds", -1.0), r"seconds -1.0 is not a finite number"),
    "seconds_text": (_set("seconds", "1"), r"seconds '1' is not a finite number"),
    "history_beyond_round": (_set("round", 1),
                             r"run 0's history has length 2, not the 1 rounds done"),
    "history_short": (_history(lambda h: [h[0][:1]]),
                      r"run 0's history has length 1, not the 2 rounds done"),
    "history_out_of_order": (_history(lambda h: [h[0][::-1]]),
                             r"record 1 of run 0's history is of round 2"),
    "history_of_more_runs": (_history(lambda h: h * 2),
                             r"the history is of 2 runs, the experiment has 1"),
    "leaf_shape": (_first_float_leaf(lambda x: np.zeros((*x.shape, 2), x.dtype)),
                   r"state \S+ is float32\((\d+, )+2\), the experiment's float32\("),
    "leaf_dtype": (_first_float_leaf(lambda x: x.astype(np.float64)),
                   r"state \S+ is float64\(.*\), the experiment's float32\("),
    "leaf_nan": (_first_float_leaf(_nan_at_0), r"state \S+ is not finite"),
    "leaf_inf": (_first_float_leaf(lambda x: np.full_like(x, np.inf)),
                 r"state \S+ is not finite"),
    # Issue 34: finite but forged contents.
    "parameters_1e30": (_first_float_leaf(lambda x: np.full_like(x, 1e30)),
                        r"state \S+ holds values beyond 1e\+10 in magnitude"),
    "zero_sample_counts": (_leaf("num_samples", np.zeros_like),
                           r"state \S*num_samples\S* is not the experiment's data "
                           "counts"),
    "inflated_sample_counts": (_leaf("num_samples", lambda x: x * 1000),
                               r"state \S*num_samples\S* is not the experiment's"),
    "accuracy_750_percent": (_record("personalized_accuracy", 7.5),
                             r"record 1 of run 0's history: its personalized "
                             r"accuracy 7.5 is not in \[0, 1\]"),
    "accuracy_negative": (_record("personalized_client_mean", -0.1),
                          r"personalized client_mean -0.1 is not in \[0, 1\]"),
    "accuracy_text": (_record("personalized_accuracy", "0.9"),
                      r"personalized accuracy '0.9' is not in \[0, 1\]"),
    "loss_nan": (_record("train_loss", float("nan")),
                 r"its train_loss nan is not a finite number"),
    "dropped_unknown_client": (_record("dropped_clients", [99]),
                               r"its dropped_clients \[99\] are not distinct "
                               r"clients in \[0, 4\)"),
}


@pytest.mark.parametrize("case", TAMPERED)
def test_a_checkpoint_that_does_not_fit_the_experiment_is_refused(setup, complete,
                                                                  tmp_path, case):
  tamper, match = TAMPERED[case]
  path = tmp_path / NAME
  shutil.copy(complete[0], path)
  payload = serialization.msgpack_restore(path.read_bytes())
  tamper(payload)
  path.write_bytes(serialization.msgpack_serialize(payload))
  rounds = []
  with pytest.raises(ValueError) as error:
    _resume(setup, tmp_path, lambda record: rounds.append(record.round))
  message = str(error.value)
  assert message.startswith(f"checkpoint {path}: ") and "\n" not in message
  assert re.search(match, message), message
  assert rounds == []  # refused before any round ran


class _Killed(Exception):
  pass


def test_without_resume_a_checkpoint_is_neither_read_nor_kept(setup, tmp_path):
  def kill_at_round_2(record):
    if record.round == 2:
      raise _Killed

  with pytest.raises(_Killed):  # leaves a checkpoint at round 1
    simulate.run("fedavg", CONFIG, 0, setup=setup, on_round=kill_at_round_2,
                 checkpoint_dir=str(tmp_path), checkpoint_every=1)
  rounds = []
  fresh = simulate.run("fedavg", CONFIG, 0, setup=setup,
                       on_round=lambda record: rounds.append(record.round),
                       checkpoint_dir=str(tmp_path), checkpoint_every=1)
  assert rounds == [1, 2]
  assert _without_time(fresh) == _without_time(simulate.run("fedavg", CONFIG, 0,
                                                            setup=setup))
  payload = serialization.msgpack_restore((tmp_path / NAME).read_bytes())
  assert payload["round"] == 2
