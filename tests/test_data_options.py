"""The papers' data handling as configuration: `samples_per_client`,
`test_fraction`, `test_split` (`pflax.simulate.ExperimentConfig`)."""

import json

import numpy as np
import pytest

from pflax import data
from pflax import simulate
from pflax._src.cli import main as cli

CLI = ["--clients", "6", "--rounds", "2", "--model", "mlp", "--no-progress",
       "--no-compilation-cache"]
TEST_OFFSET = 10_000
"""Test-split samples carry their index plus this, training samples their index."""


def _dataset(n=400, k=4, test=0):
  """A dataset whose one feature is each sample's id, `n` samples of `k`
  balanced classes (and `test` more as the dataset's own test split)."""
  ids = np.arange(n, dtype=np.float32)[:, None]
  labels = np.arange(n) % k
  if not test:
    return data.from_arrays(ids, labels)
  test_ids = TEST_OFFSET + np.arange(test, dtype=np.float32)[:, None]
  return data.from_arrays(ids, labels, test_images=test_ids,
                          test_labels=np.arange(test) % k)


def _federation(dataset, seed=0, **fields):
  config = simulate.ExperimentConfig(**{"clients": 4, "batch_size": 1, **fields})
  return simulate.prepare(config, seed, dataset=dataset).federation


def _ids(fed, i, test=False):
  """Client i's sample ids (training, or test)."""
  x, valid = (fed.test_x, fed.test_mask) if test else (fed.x, fed.mask)
  return set(x[i, valid[i], 0].astype(int).tolist())


def _all_ids(fed, i):
  return _ids(fed, i) | _ids(fed, i, test=True)


@pytest.mark.parametrize("partition", ["pathological", "dirichlet"])
def test_samples_per_client_keeps_a_seeded_subset_of_each_client(partition):
  ds = _dataset()
  fields = dict(partition=partition, dirichlet_alpha=0.5)
  full = _federation(ds, **fields)
  capped = _federation(ds, samples_per_client=60, **fields)
  for i in range(4):
    assert len(_all_ids(capped, i)) == min(60, len(_all_ids(full, i)))
    assert _all_ids(capped, i) <= _all_ids(full, i)        # a subset of its own
  again = _federation(ds, samples_per_client=60, **fields)
  other = _federation(ds, seed=1, samples_per_client=60, **fields)
  assert all(_all_ids(again, i) == _all_ids(capped, i) for i in range(4))
  assert any(_all_ids(other, i) != _all_ids(capped, i) for i in range(4))


def test_samples_per_client_above_every_client_changes_nothing():
  ds = _dataset()
  full, capped = _federation(ds), _federation(ds, samples_per_client=10_000)
  assert all(_all_ids(full, i) == _all_ids(capped, i) for i in range(4))


def test_groups_draw_exactly_samples_per_client_split_by_test_fraction():
  ds = _dataset(n=2000, k=10)
  fed = _federation(ds, partition="groups", clients=10, samples_per_client=100,
                    test_fraction=0.2)
  sizes = [len(_all_ids(fed, i)) for i in range(10)]
  assert sizes == [100] * 10
  # Client 0 (labels 0, 1, 2 dominant): 20 IID, 2 of each class, 1 test each is
  # round(0.4) clipped to 1; the dominant 2 + 27, 2 + 27, 2 + 26: round(5.8) = 6
  # and round(5.6) = 6 test samples.
  assert fed.test_mask[0].sum() == 3 * 6 + 7 * 1
  with pytest.raises(ValueError, match="samples_per_client=1000 is infeasible"):
    _federation(ds, partition="groups", clients=10, samples_per_client=1000)


@pytest.mark.parametrize("fraction", [0.2, 0.4])
def test_test_fraction_sets_each_clients_split(fraction):
  # 4 clients of 2 classes on 400 samples of 4 classes: 50 of each class each.
  fed = _federation(_dataset(), classes_per_client=2, test_fraction=fraction)
  tests = fed.test_mask.sum(axis=1)
  assert tests.tolist() == [2 * round(50 * fraction)] * 4
  assert fed.num_samples.tolist() == [100 - t for t in tests]


def test_clients_split_pools_the_datasets_train_and_test_splits():
  fed = _federation(_dataset(n=400, test=200))
  ids = set().union(*(_all_ids(fed, i) for i in range(4)))
  assert len(ids) == 600 and max(ids) >= TEST_OFFSET
  trained = set().union(*(_ids(fed, i) for i in range(4)))
  assert any(j >= TEST_OFFSET for j in trained)     # test-split samples train too


def test_dataset_split_tests_each_client_on_the_test_split():
  fed = _federation(_dataset(n=400, test=200), test_split="dataset",
                    test_fraction=0.5)                      # unused
  for i in range(4):
    assert all(j < TEST_OFFSET for j in _ids(fed, i))
    assert _ids(fed, i, test=True) and all(j >= TEST_OFFSET
                                           for j in _ids(fed, i, test=True))
  assert fed.num_samples.sum() == 400                 # the whole train split
  assert fed.test_mask.sum() == 200                  # the whole test split, dealt
  # Dealt with each client's classes: 2 classes each, 50 test samples of each
  # class shared by its 2 holders.
  labels = [set(fed.test_y[i, fed.test_mask[i]].tolist()) for i in range(4)]
  assert all(labels[i] == set(fed.y[i, fed.mask[i]].tolist()) for i in range(4))


def test_dataset_split_needs_a_test_split():
  with pytest.raises(ValueError, match="^test_split: the dataset 'arrays' has no test "
                                       "split of its own; use 'clients'"):
    _federation(_dataset(), test_split="dataset")


@pytest.mark.parametrize("fields,message", [
    (dict(test_fraction=0.0), r"test_fraction must be in \(0, 1\), got 0.0"),
    (dict(test_fraction=1.0), r"test_fraction must be in \(0, 1\), got 1.0"),
    (dict(test_fraction=float("nan")), r"test_fraction must be a finite number"),
    (dict(test_split="test"), r"test_split must be one of \('clients', 'dataset'\)"),
    (dict(samples_per_client=0), "samples_per_client must be None or >= 1, got 0"),
])
def test_out_of_range_fields_are_named_before_any_work(fields, message):
  with pytest.raises(ValueError, match=message):
    simulate.run("fedavg", simulate.ExperimentConfig(**fields), 0)


def test_cli_flags_are_recorded(capsys, tmp_path):
  assert cli.main(CLI + ["--samples-per-client", "600", "--test-fraction", "0.2",
                         "--test-split", "dataset", "--print-config",
                         "--out", str(tmp_path)]) == 0
  config = json.loads(capsys.readouterr().out)
  assert (config["samples_per_client"], config["test_fraction"],
          config["test_split"]) == (600, 0.2, "dataset")
  defaults = simulate.ExperimentConfig()
  assert (defaults.samples_per_client, defaults.test_fraction,
          defaults.test_split) == (None, 0.25, "clients")


@pytest.mark.parametrize("flags,message", [
    (["--test-split", "dataset"], "--test-split: the dataset 'digits' has no test "
                                  "split"),
    (["--test-fraction", "1"], r"--test-fraction must be in \(0, 1\)"),
])
def test_cli_errors_name_the_flag(flags, message, tmp_path):
  with pytest.raises(SystemExit, match="^pflax-run: " + message):
    cli.main(CLI + flags + ["--out", str(tmp_path)])
