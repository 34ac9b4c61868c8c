"""Tests for pflax.data partitioners, stratified split and client stacking.

References are plain NumPy loops over the labels; the partitions come from the
offline digits dataset (1,797 samples, 10 classes).
"""

import doctest
import importlib

import numpy as np
import pytest

from pflax import data

K = 10


@pytest.fixture(scope="module")
def labels():
  return data.load_digits().labels


def _reference_counts(labels, indices, num_classes):
  return np.array([[int(np.sum(labels[idx] == k)) for k in range(num_classes)]
                   for idx in indices])


def _assert_valid(part, labels, num_clients, num_classes=K):
  """Disjoint sorted int index arrays whose class counts match the labels."""
  assert len(part.indices) == num_clients
  for idx in part.indices:
    assert idx.ndim == 1 and np.issubdtype(idx.dtype, np.integer)
    assert np.all(np.diff(idx) > 0)
  everything = np.concatenate(part.indices)
  assert len(np.unique(everything)) == len(everything)
  assert everything.min() >= 0 and everything.max() < len(labels)
  assert part.counts.dtype == np.int64
  assert part.counts.shape == (num_clients, num_classes)
  np.testing.assert_array_equal(
      part.counts, _reference_counts(labels, part.indices, num_classes))


PARTITIONERS = {
    "dirichlet": lambda y, seed: data.dirichlet(y, 20, 0.1, seed=seed),
    "pathological": lambda y, seed: data.pathological(y, 20, 2, seed=seed),
    "pathological_det": lambda y, seed: data.pathological(
        y, 20, 2, class_assignment_mode="deterministic", seed=seed),
    "groups": lambda y, seed: data.groups(y, 20, seed=seed),
}


@pytest.mark.parametrize("name", PARTITIONERS)
def test_partition_is_valid_and_seeded(labels, name):
  make = PARTITIONERS[name]
  part = make(labels, 0)
  _assert_valid(part, labels, 20)
  again = make(labels, 0)
  for a, b in zip(part.indices, again.indices):
    np.testing.assert_array_equal(a, b)
  other = make(labels, 1)
  assert any(not np.array_equal(a, b) for a, b in zip(part.indices, other.indices))


def test_class_counts_by_hand():
  counts = data.class_counts([0, 2, 2, 1, 0], [[0, 1], [2, 3, 4], []], 3)
  np.testing.assert_array_equal(counts, [[1, 0, 1], [1, 1, 1], [0, 0, 0]])
  assert counts.dtype == np.int64


# --- dirichlet ----------------------------------------------------------------


def test_dirichlet_assigns_every_sample_and_honours_min_size(labels):
  part = data.dirichlet(labels, 20, 0.1, min_partition_size=30, seed=3)
  assert sum(len(idx) for idx in part.indices) == len(labels)
  assert part.counts.sum(axis=1).min() >= 30


@pytest.mark.parametrize("max_tries", [1, 100])
def test_dirichlet_terminates_on_hard_case(labels, max_tries):
  # alpha = 0.01 over 100 clients: nearly every draw leaves clients empty, so the
  # bounded redraws end in the repair.
  part = data.dirichlet(labels, 100, 0.01, seed=0, max_tries=max_tries)
  _assert_valid(part, labels, 100)
  assert part.counts.sum() == len(labels)
  assert part.counts.sum(axis=1).min() >= 10


def test_dirichlet_alpha_controls_skew(labels):
  global_mix = np.bincount(labels) / len(labels)
  iid = data.dirichlet(labels, 10, 1000.0, seed=0).counts
  iid_mix = iid / iid.sum(axis=1, keepdims=True)
  assert np.abs(iid_mix - global_mix).max() < 0.05
  skewed = data.dirichlet(labels, 10, 0.01, min_partition_size=0, seed=0).counts
  # Each class lands mostly on one client (IID: about 1 / M).
  assert np.mean(skewed.max(axis=0) / skewed.sum(axis=0)) > 0.7
  assert np.mean(iid.max(axis=0) / iid.sum(axis=0)) < 0.15


class _FixedDraws:
  """A stand-in for `np.random.default_rng`: reverses every class, fixed proportions."""

  def __init__(self, proportions):
    self.proportions = list(proportions)
    self.alphas = []

  def permutation(self, x):
    return np.asarray(x)[::-1]

  def dirichlet(self, alpha):
    self.alphas.append(np.asarray(alpha))
    return np.asarray(self.proportions.pop(0))


def test_dirichlet_cut_points_by_hand(monkeypatch):
  """Class k's shuffled samples are cut at `floor(n_k * cumsum(q_k))[:-1]`."""
  labels = np.array([0] * 10 + [1] * 5)
  draws = _FixedDraws([[0.36, 0.29, 0.35],    # n = 10: cuts floor(3.6, 6.5) = 3, 6
                       [0.5, 0.14, 0.36]])    # n = 5: cuts floor(2.5, 3.2) = 2, 3
  monkeypatch.setattr(np.random, "default_rng", lambda seed: draws)
  part = data.dirichlet(labels, 3, 0.7, min_partition_size=0, max_tries=1)
  # Class 0 shuffled to 9..0 -> [9 8 7 | 6 5 4 | 3 2 1 0]; class 1 to 14..10 ->
  # [14 13 | 12 | 11 10].
  expected = [[7, 8, 9, 13, 14], [4, 5, 6, 12], [0, 1, 2, 3, 10, 11]]
  for got, want in zip(part.indices, expected, strict=True):
    np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(part.counts, [[3, 2], [3, 1], [4, 2]])
  for alpha in draws.alphas:
    np.testing.assert_array_equal(alpha, [0.7, 0.7, 0.7])


def test_dirichlet_min_size_zero_allows_empty_clients(labels):
  part = data.dirichlet(labels, 50, 0.01, min_partition_size=0, seed=0)
  _assert_valid(part, labels, 50)
  assert part.counts.sum(axis=1).min() == 0


# --- pathological -------------------------------------------------------------


@pytest.mark.parametrize("mode", ["random", "deterministic"])
@pytest.mark.parametrize("num_clients,per_client", [(20, 2), (7, 3), (3, 10), (3, 2)])
def test_pathological_classes_per_client_and_balance(labels, mode, num_clients,
                                                     per_client):
  part = data.pathological(labels, num_clients, per_client,
                           class_assignment_mode=mode, seed=5)
  _assert_valid(part, labels, num_clients)
  held = part.counts > 0
  np.testing.assert_array_equal(held.sum(axis=1), per_client)
  holders = held.sum(axis=0)
  assert holders.max() - holders.min() <= 1
  assert holders.sum() == num_clients * per_client
  sizes = np.bincount(labels)
  for k in range(K):
    shares = part.counts[held[:, k], k]
    assert shares.sum() == (sizes[k] if holders[k] else 0)
    if holders[k]:
      assert shares.max() - shares.min() <= 1


def test_pathological_deterministic_formula(labels):
  part = data.pathological(labels, 20, 2, class_assignment_mode="deterministic")
  for i in range(20):
    expected = sorted({(i * 2 + r) % K for r in range(2)})
    np.testing.assert_array_equal(np.flatnonzero(part.counts[i]), expected)


def test_pathological_random_assignment_varies(labels):
  def class_sets(seed):
    counts = data.pathological(labels, 20, 2, seed=seed).counts
    return [tuple(np.flatnonzero(row)) for row in counts]
  # Not the cyclic structure (which has only 5 distinct pairs for c=2, K=10).
  assert len(set(class_sets(0))) > 5
  assert class_sets(0) != class_sets(1)


def test_pathological_extra_holders_go_to_random_classes(labels):
  # 7 clients x 2 classes are 14 holders of 10 classes: 4 classes have a
  # second holder, drawn anew with each seed (not always the first classes).
  doubled = set()
  for seed in range(10):
    holders = (data.pathological(labels, 7, 2, seed=seed).counts > 0).sum(axis=0)
    assert sorted(holders.tolist()) == [1] * 6 + [2] * 4
    doubled |= set(np.flatnonzero(holders == 2).tolist())
  assert doubled == set(range(K))


# --- groups -------------------------------------------------------------------


def test_groups_dominant_labels_and_iid_fraction(labels):
  label_groups = ((0, 1, 2), (2, 3, 4), (4, 5, 6), (6, 7, 8), (8, 9, 0))
  part = data.groups(labels, 10, iid_fraction=0.2, samples_per_client=100, seed=0)
  _assert_valid(part, labels, 10)
  np.testing.assert_array_equal(part.counts.sum(axis=1), 100)
  for i, row in enumerate(part.counts):
    dominant = np.array(label_groups[i % 5])
    others = np.setdiff1d(np.arange(K), dominant)
    # 20 IID samples spread evenly (2 per label), 80 over the dominant labels.
    np.testing.assert_array_equal(row[others], 2)
    assert row[dominant].sum() == 80 + 2 * 3
    assert row[dominant].max() - row[dominant].min() <= 1
    assert set(np.argsort(row)[-3:]) == set(dominant)


@pytest.mark.parametrize("iid_fraction", [0.0, 0.1, 0.5, 1.0])
def test_groups_iid_fraction_is_approximately_met(labels, iid_fraction):
  part = data.groups(labels, 15, iid_fraction=iid_fraction, samples_per_client=60)
  for i, row in enumerate(part.counts):
    dominant = list(((0, 1, 2), (2, 3, 4), (4, 5, 6), (6, 7, 8), (8, 9, 0))[i % 5])
    outside = 1 - row[dominant].sum() / row.sum()
    # The IID share lands on the 7 non-dominant labels with probability 7 / 10.
    assert abs(outside - iid_fraction * 0.7) <= 0.05
  if iid_fraction == 1.0:
    assert np.all(part.counts.max(axis=1) - part.counts.min(axis=1) <= 1)


def test_groups_default_size_is_largest_feasible(labels):
  part = data.groups(labels, 20, iid_fraction=0.2)
  size = len(part.indices[0])
  assert size > 0
  np.testing.assert_array_equal(part.counts.sum(axis=1), size)
  data.groups(labels, 20, iid_fraction=0.2, samples_per_client=size)
  with pytest.raises(ValueError,
                     match=f"samples_per_client.*largest feasible value is {size}"):
    data.groups(labels, 20, iid_fraction=0.2, samples_per_client=size + 1)


def test_groups_quotas_by_hand():
  y = np.repeat(np.arange(10), 100)
  part = data.groups(y, 10, iid_fraction=0.25, samples_per_client=10)
  # round(0.25 * 10) = 3 IID samples (client 0: labels 0, 1, 2), and 7 over the
  # dominant labels (0, 1, 2) as 3, 2, 2.
  np.testing.assert_array_equal(part.counts[0], [4, 3, 3, 0, 0, 0, 0, 0, 0, 0])
  # Client 6 is the second client of group 1: IID labels 6, 7, 8 and the extra
  # dominant sample on label 3.
  np.testing.assert_array_equal(part.counts[6], [0, 0, 2, 3, 2, 0, 1, 1, 1, 0])


def test_groups_custom_label_groups(labels):
  part = data.groups(labels, 4, iid_fraction=0.0, samples_per_client=40,
                     label_groups=((3,), (7, 9)))
  np.testing.assert_array_equal(np.flatnonzero(part.counts[0]), [3])
  np.testing.assert_array_equal(np.flatnonzero(part.counts[1]), [7, 9])
  np.testing.assert_array_equal(part.counts[3, [7, 9]], [20, 20])


# --- train_test_split ---------------------------------------------------------


@pytest.mark.parametrize("test_fraction", [0.25, 0.5])
def test_train_test_split_is_stratified_and_disjoint(labels, test_fraction):
  part = data.dirichlet(labels, 10, 0.3, seed=2)
  train, test = data.train_test_split(part, labels, test_fraction=test_fraction,
                                      seed=0)
  _assert_valid(train, labels, 10)
  _assert_valid(test, labels, 10)
  for idx, tr, te in zip(part.indices, train.indices, test.indices):
    assert len(np.intersect1d(tr, te)) == 0
    np.testing.assert_array_equal(np.sort(np.concatenate([tr, te])), idx)
  np.testing.assert_array_equal(train.counts + test.counts, part.counts)
  n = part.counts
  expected = np.where(n >= 2, np.clip(np.floor(test_fraction * n + 0.5), 1, n - 1), 0)
  np.testing.assert_array_equal(test.counts, expected)
  big = n >= 20
  mix = test.counts[big] / n[big]
  assert np.all(np.abs(mix - test_fraction) < 0.05)
  assert abs(test.counts.sum() / n.sum() - test_fraction) < 0.02


@pytest.mark.parametrize("test_fraction,expected", [
    (0.25, [0, 1, 1, 1]),  # round(0.5) = 1, round(0.75) = 1, round(1.25) = 1
    (0.1, [0, 1, 1, 1]),   # rounds to 0, clipped up to 1
    (0.9, [0, 1, 2, 4]),   # round(2.7) = 3, clipped down to n - 1 = 2
])
def test_train_test_split_small_classes(test_fraction, expected):
  labels = np.array([0, 1, 1, 2, 2, 2, 3, 3, 3, 3, 3])
  part = data.Partition([np.arange(11)], np.array([[1, 2, 3, 5]]))
  train, test = data.train_test_split(part, labels, test_fraction=test_fraction)
  # A class with n = 1 stays in train; with n >= 2 both sides get >= 1.
  np.testing.assert_array_equal(test.counts, [expected])
  np.testing.assert_array_equal(train.counts, [[1, 2, 3, 5]] - np.array(expected))


def test_train_test_split_seeded(labels):
  part = data.pathological(labels, 20, 2)
  a = data.train_test_split(part, labels, seed=0)[1].indices
  b = data.train_test_split(part, labels, seed=0)[1].indices
  c = data.train_test_split(part, labels, seed=1)[1].indices
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  assert any(not np.array_equal(x, y) for x, y in zip(a, c))


# --- stack_clients ------------------------------------------------------------


def test_stack_clients_round_trip():
  digits = data.load_digits()
  indices = data.pathological(digits.labels, 5, 2, seed=0).indices
  indices = [np.random.default_rng(i).permutation(idx) for i, idx in enumerate(indices)]
  indices.append(np.array([], np.int64))
  out = data.stack_clients(digits.images, digits.labels, indices, pad_to_multiple=32)
  longest = max(len(idx) for idx in indices)
  length = out.mask.shape[1]
  assert length % 32 == 0 and longest <= length < longest + 32
  assert out.x.shape == (6, length, 8, 8, 1) and out.x.dtype == np.float32
  assert out.y.shape == (6, length) and out.y.dtype == np.int32
  assert out.mask.dtype == bool
  assert out.num_samples.dtype == np.int32
  np.testing.assert_array_equal(out.num_samples, [len(idx) for idx in indices])
  np.testing.assert_array_equal(out.mask.sum(axis=1), out.num_samples)
  for i, idx in enumerate(indices):
    np.testing.assert_array_equal(out.x[i][out.mask[i]], digits.images[idx])
    np.testing.assert_array_equal(out.y[i][out.mask[i]], digits.labels[idx])
    assert not out.x[i][~out.mask[i]].any() and not out.y[i][~out.mask[i]].any()


def test_stack_clients_by_hand():
  out = data.stack_clients(np.arange(10.0).reshape(5, 2), np.arange(5),
                           [[4, 0], [2]])
  np.testing.assert_array_equal(out.x, [[[8, 9], [0, 1]], [[4, 5], [0, 0]]])
  np.testing.assert_array_equal(out.y, [[4, 0], [2, 0]])
  np.testing.assert_array_equal(out.mask, [[True, True], [True, False]])


# --- docstrings -----------------------------------------------------------------


@pytest.mark.parametrize("module", ["clients", "datasets", "dirichlet", "groups",
                                    "partition", "pathological", "split"])
def test_docstring_examples(module):
  mod = importlib.import_module(f"pflax._src.data.{module}")
  names = {name: getattr(data, name) for name in data.__all__}
  result = doctest.testmod(mod, extraglobs={"np": np, **names})
  assert result.attempted > 0 and result.failed == 0


# --- bad inputs ---------------------------------------------------------------

_Y = np.repeat(np.arange(4), 10)
_X = np.zeros((40, 2))
_PART = data.Partition([np.arange(20), np.arange(20, 40)],
                       np.array([[10, 10, 0, 0], [0, 0, 10, 10]]))
_G = ((0, 1),)

BAD_INPUTS = {
    "labels_2d": (lambda: data.dirichlet(_Y.reshape(4, 10), 2, 0.5), "labels"),
    "labels_float": (lambda: data.dirichlet(_Y.astype(float), 2, 0.5), "labels"),
    "labels_negative": (lambda: data.dirichlet(_Y - 1, 2, 0.5), "labels"),
    "labels_above_K": (lambda: data.dirichlet(_Y, 2, 0.5, num_classes=3),
                       r"labels must lie in \[0, num_classes\)"),
    "labels_empty": (lambda: data.pathological([], 4, 2), "labels"),
    "dir_clients_0": (lambda: data.dirichlet(_Y, 0, 0.5), "num_clients"),
    "dir_clients_float": (lambda: data.dirichlet(_Y, 2.5, 0.5), "num_clients"),
    "dir_alpha_0": (lambda: data.dirichlet(_Y, 2, 0.0), "alpha"),
    "dir_alpha_neg": (lambda: data.dirichlet(_Y, 2, -1.0), "alpha"),
    "dir_min_size_infeasible": (
        lambda: data.dirichlet(_Y, 5, 0.5, min_partition_size=9), "min_partition_size"),
    "dir_min_size_neg": (
        lambda: data.dirichlet(_Y, 2, 0.5, min_partition_size=-1), "min_partition_size"),
    "dir_max_tries_0": (lambda: data.dirichlet(_Y, 2, 0.5, max_tries=0), "max_tries"),
    "path_clients_0": (lambda: data.pathological(_Y, 0, 2), "num_clients"),
    "path_c_0": (lambda: data.pathological(_Y, 4, 0), "num_classes_per_partition"),
    "path_c_above_K": (lambda: data.pathological(_Y, 4, 5),
                       r"num_classes_per_partition must lie in \[1, num_classes\]"),
    "path_mode": (lambda: data.pathological(_Y, 4, 2, class_assignment_mode="first"),
                  "class_assignment_mode"),
    "path_too_few_samples": (lambda: data.pathological(_Y[:31], 8, 4),
                             "labels: class 3 has 1 samples"),
    "groups_clients_0": (lambda: data.groups(_Y, 0, label_groups=_G), "num_clients"),
    "groups_iid_fraction": (
        lambda: data.groups(_Y, 2, iid_fraction=1.5, label_groups=_G), "iid_fraction"),
    "groups_label_above_K": (lambda: data.groups(_Y, 2), r"label_groups\[1\]"),
    "groups_none": (lambda: data.groups(_Y, 2, label_groups=()), "label_groups"),
    "groups_repeated": (lambda: data.groups(_Y, 2, label_groups=((0, 0),)),
                        r"label_groups\[0\]"),
    "groups_empty_group": (lambda: data.groups(_Y, 2, label_groups=((0,), ())),
                           r"label_groups\[1\]"),
    "groups_size_0": (
        lambda: data.groups(_Y, 2, label_groups=_G, samples_per_client=0),
        "samples_per_client"),
    "groups_size_infeasible": (
        lambda: data.groups(_Y, 2, label_groups=_G, samples_per_client=30),
        "samples_per_client"),
    "groups_no_size_fits": (lambda: data.groups(_Y[:2], 3, label_groups=((0,),)),
                            "samples_per_client >= 1"),
    "split_fraction_0": (
        lambda: data.train_test_split(_PART, _Y, test_fraction=0.0), "test_fraction"),
    "split_fraction_1": (
        lambda: data.train_test_split(_PART, _Y, test_fraction=1.0), "test_fraction"),
    "split_counts_rows": (
        lambda: data.train_test_split(_PART._replace(counts=_PART.counts[:1]), _Y),
        "partition"),
    "split_labels_above_K": (lambda: data.train_test_split(_PART, _Y + 1), "labels"),
    "split_index_out_of_range": (lambda: data.train_test_split(_PART, _Y[:30]),
                                 r"partition.indices\[1\]"),
    "stack_pad_0": (
        lambda: data.stack_clients(_X, _Y, _PART.indices, pad_to_multiple=0),
        "pad_to_multiple"),
    "stack_images_rows": (lambda: data.stack_clients(_X[:39], _Y, _PART.indices),
                          "images"),
    "stack_labels_2d": (lambda: data.stack_clients(_X, _Y[:, None], _PART.indices),
                        "labels"),
    "stack_index_out_of_range": (lambda: data.stack_clients(_X, _Y, [[0, 40]]),
                                 r"indices\[0\]"),
    "stack_index_2d": (lambda: data.stack_clients(_X, _Y, [[[0]]]), r"indices\[0\]"),
    "stack_no_clients": (lambda: data.stack_clients(_X, _Y, []), "indices"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_inputs_raise_value_error_naming_argument(case):
  call, match = BAD_INPUTS[case]
  with pytest.raises(ValueError, match=match):
    call()
