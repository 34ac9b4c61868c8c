"""Per-client stratified train/test split, or a dataset's own test split dealt to
the clients."""

import numpy as np
import numpy.typing as npt

from pflax._src.data import _validation
from pflax._src.data import partition as partition_lib


def _num_test(class_sizes: np.ndarray, test_fraction: float) -> np.ndarray:
  """`round(f n)` test samples per class, clipped to `[1, n - 1]` when `n >= 2`;
  a class with a single sample keeps it for training."""
  rounded = np.floor(test_fraction * class_sizes + 0.5).astype(np.int64)
  return np.where(class_sizes >= 2, np.clip(rounded, 1, class_sizes - 1), 0)


def _partition_counts(partition: partition_lib.Partition) -> np.ndarray:
  """The partition's `(M, K)` counts, after checking they match its M index arrays."""
  counts = np.asarray(partition.counts)
  if counts.ndim != 2 or counts.shape[1] < 1 or counts.shape[0] != len(
      partition.indices):
    raise ValueError(
        "partition must hold M index arrays and counts of shape (M, K) with K >= 1, "
        f"got {len(partition.indices)} arrays and counts of shape {counts.shape}.")
  return counts


def train_test_split(
    partition: partition_lib.Partition,
    labels: npt.ArrayLike,
    *,
    test_fraction: float = 0.25,
    seed: int = 0,
) -> tuple[partition_lib.Partition, partition_lib.Partition]:
  """Splits every client's samples into train and test, stratified by class.

  For each client and class with `n` samples, `round(test_fraction * n)` random
  samples go to the test side, clipped to `[1, n - 1]` so both sides see every
  class with at least two samples; a class with one sample stays in training.
  Train and test therefore have (up to rounding) the same class mix.

  Args:
    partition: the clients' samples, e.g. from `dirichlet` or `pathological`.
    labels: class label of every sample, shape `(N,)`, the labels the partition
      was built from.
    test_fraction: share of each class that goes to the test side, in `(0, 1)`.
    seed: seed of `np.random.default_rng`.

  Returns:
    `(train, test)` partitions over the same `M` clients and `K` classes; their
    indices are disjoint and together equal `partition.indices`.

  Example:
    >>> import numpy as np
    >>> from pflax.data import pathological, train_test_split
    >>> labels = np.repeat(np.arange(10), 100)
    >>> train, test = train_test_split(pathological(labels, 10, 1), labels)
    >>> int(train.counts.sum()), int(test.counts.sum())
    (750, 250)

  References:
    Lee and Choi, "Class-Wise Federated Averaging for Efficient Personalization"
    (cwFedAvg), Sec. 5: each client's data is split 75% / 25%.
  """
  counts = _partition_counts(partition)
  labels, num_classes = _validation.labels(labels, counts.shape[1])
  _validation.fraction(test_fraction, "test_fraction", open_interval=True)
  indices = _validation.indices(partition.indices, len(labels), "partition.indices")
  rng = np.random.default_rng(seed)
  train, test = [], []
  for idx in indices:
    client_labels = labels[idx]
    num_test = _num_test(np.bincount(client_labels, minlength=num_classes),
                         test_fraction)
    chosen = [rng.permutation(idx[client_labels == k])[:num_test[k]]
              for k in range(num_classes)]
    test_idx = np.concatenate(chosen)
    test.append(test_idx)
    train.append(np.setdiff1d(idx, test_idx))
  return (partition_lib.make_partition(labels, train, num_classes),
          partition_lib.make_partition(labels, test, num_classes))


def _largest_remainder(counts: np.ndarray, totals: np.ndarray) -> np.ndarray:
  """`(M, K)` shares of `totals[j]` proportional to `counts[:, j]`, rounded by
  largest remainder (ties to the lower client); zero where a column is all zero."""
  held = counts.sum(axis=0)
  exact = counts * totals
  shares = exact // np.maximum(held, 1)
  remainders = exact % np.maximum(held, 1)
  missing = np.where(held > 0, totals - shares.sum(axis=0), 0)
  for j in np.flatnonzero(missing):
    shares[np.argsort(-remainders[:, j], kind="stable")[:missing[j]], j] += 1
  return shares


def deal_test_split(
    partition: partition_lib.Partition,
    test_labels: npt.ArrayLike,
    *,
    seed: int = 0,
) -> partition_lib.Partition:
  """Deals a dataset's own test split to the clients, with their class mix.

  For each class `j`, let `T_j` be its test samples and `n_ij` client `i`'s
  training samples of `j` (`partition.counts`), `N_j = sum_i n_ij`. Client `i`
  gets `T_j n_ij / N_j` of them, rounded by largest remainder: the floor each,
  then one more to each of the clients with the largest remainders (ties to
  the lower client index) until the `T_j` are dealt. The test samples of `j`
  are shuffled (`np.random.default_rng(seed)`) and dealt in client order, so
  the clients' test sets are disjoint. A client with `n_ij = 0` gets no test
  sample of `j`; a class no client trains on is left out.

  Args:
    partition: the clients' training samples, e.g. from `dirichlet`.
    test_labels: labels of the dataset's test split, shape `(T,)`, in `[0, K)`.
    seed: seed of the shuffles.

  Returns:
    A `Partition` of the test split's indices over the same `M` clients.

  Example:
    >>> import numpy as np
    >>> from pflax.data import Partition, deal_test_split
    >>> part = Partition([np.arange(4), np.arange(4, 6)], np.array([[3, 1], [1, 1]]))
    >>> test = deal_test_split(part, np.repeat([0, 1], [8, 4]), seed=0)
    >>> test.counts.tolist()
    [[6, 2], [2, 2]]
  """
  counts = _partition_counts(partition)
  test_labels, num_classes = _validation.labels(test_labels, counts.shape[1],
                                                name="test_labels")
  shares = _largest_remainder(counts.astype(np.int64),
                              np.bincount(test_labels, minlength=num_classes))
  rng = np.random.default_rng(seed)
  dealt = [[] for _ in range(len(counts))]
  for j in range(num_classes):
    pool = rng.permutation(np.flatnonzero(test_labels == j))
    ends = np.cumsum(shares[:, j])
    for i, chunk in enumerate(np.split(pool[:ends[-1]], ends[:-1])):
      dealt[i].append(chunk)
  return partition_lib.make_partition(
      test_labels, [np.concatenate(chunks) for chunks in dealt], num_classes)
