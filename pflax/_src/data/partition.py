"""The `Partition` result shared by every partitioner, and its class counts."""

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt


class Partition(NamedTuple):
  """Samples held by each of `M` clients.

  Attributes:
    indices: one sorted int64 array of sample indices per client (length `M`);
      no sample appears twice. Shuffle when batching.
    counts: int64 array of shape `(M, K)`; `counts[i, j]` is the number of samples
      of class `j` held by client `i` (the `class_dist` of `cw_fedavg`).
  """

  indices: list[np.ndarray]
  counts: np.ndarray


def class_counts(labels: npt.ArrayLike, indices: Sequence[npt.ArrayLike],
                 num_classes: int) -> np.ndarray:
  """Counts, for each client, how many of its samples fall in each class.

  Args:
    labels: class labels in `[0, K)`, shape `(N,)`.
    indices: one array of sample indices per client.
    num_classes: `K`.

  Returns:
    An int64 array of shape `(M, K)`.

  Example:
    >>> class_counts([0, 1, 1, 2], [[0, 1], [2, 3]], 3)
    array([[1, 1, 0],
           [0, 1, 1]])
  """
  labels = np.asarray(labels)
  return np.stack([
      np.bincount(labels[np.asarray(idx, np.int64)], minlength=num_classes)
      for idx in indices
  ]).astype(np.int64)


def make_partition(labels: np.ndarray, indices: Sequence[np.ndarray],
                   num_classes: int) -> Partition:
  """Sorts each client's indices and attaches the class counts (trusted inputs)."""
  indices = [np.sort(np.asarray(idx, np.int64)) for idx in indices]
  return Partition(indices, class_counts(labels, indices, num_classes))
