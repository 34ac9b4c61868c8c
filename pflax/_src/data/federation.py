"""A federation: every client's training and test data as stacked host arrays."""

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from pflax._src.data import clients as clients_lib
from pflax._src.data import partition as partition_lib
from pflax._src.data import split as split_lib


class ClientData(NamedTuple):
  """One client's data: a row of a `Federation` (e.g. a Flower node's own data).

  Attributes:
    x, y, mask: training inputs `(L, ...)`, labels `(L,)` and `(L,)` bool, True
      on real samples.
    test_x, test_y, test_mask: its test split, likewise.
    num_classes: K, the number of classes of the task.
  """
  x: np.ndarray
  y: np.ndarray
  mask: np.ndarray
  test_x: np.ndarray
  test_y: np.ndarray
  test_mask: np.ndarray
  num_classes: int

  def class_counts(self) -> np.ndarray:
    """`(K,)` int32 training samples per class."""
    labels = np.asarray(self.y)[np.asarray(self.mask)]
    return np.bincount(labels, minlength=self.num_classes).astype(np.int32)


class Federation(NamedTuple):
  """Clients' data as stacked arrays (see `stack_clients`).

  Attributes:
    x, y, mask: training inputs `(M, L, ...)`, labels `(M, L)`, and `(M, L)` bool,
      True on real samples.
    test_x, test_y, test_mask: the clients' test splits.
    counts: `(M, K)` training class counts `n_ij`.
    num_samples: `(M,)` training-set sizes `n_i`.
  """
  x: np.ndarray
  y: np.ndarray
  mask: np.ndarray
  test_x: np.ndarray
  test_y: np.ndarray
  test_mask: np.ndarray
  counts: np.ndarray
  num_samples: np.ndarray

  def client(self, i: int) -> ClientData:
    """Client `i`'s row."""
    return ClientData(self.x[i], self.y[i], self.mask[i], self.test_x[i], self.test_y[i],
                      self.test_mask[i], self.counts.shape[1])


def _test_split(test, sample_shape: tuple[int, ...]) -> tuple[np.ndarray, object]:
  """Checks that `test` is a pair `(test_images, test_labels)` of images shaped
  like the training images (the labels are checked by `deal_test_split`)."""
  if not isinstance(test, (tuple, list)) or len(test) != 2:
    raise ValueError("test must be a pair (test_images, test_labels), got "
                     f"{type(test).__name__}.")
  test_images = np.asarray(test[0])
  if test_images.shape[1:] != sample_shape:
    raise ValueError(
        f"test_images must have shape (T,) + {sample_shape} (the per-sample shape of "
        f"images), got {test_images.shape}.")
  return test_images, test[1]


def federate(images: np.ndarray, labels: np.ndarray,
             partition: partition_lib.Partition, *, seed: int,
             batch_size: int = 1, test_fraction: float = 0.25,
             test: tuple[np.ndarray, np.ndarray] | None = None) -> Federation:
  """Gives each client its training and test sets and stacks them.

  By default (`test=None`, the papers' protocol) each client's samples are split
  into training and test sets, `test_fraction` of each class for test
  (`train_test_split`). With `test=(test_images, test_labels)`, the dataset's own
  test split, each client trains on its whole partition and is tested on test
  samples dealt with its class mix (`deal_test_split`: class `j`'s test samples
  shared, disjointly, in proportion to the clients' training counts `n_ij`).

  Args:
    images, labels: the dataset (its training split when `test` is given).
    partition: the clients' sample indices (e.g. `pflax.data.pathological`).
    seed: seed of the per-client train/test split, or of the dealing.
    batch_size: training data are padded to a multiple of it.
    test_fraction: each client's share of test samples (per class); unused
      with `test`.
    test: `(test_images, test_labels)`, the dataset's own test split, or None.

  Example:
    >>> import numpy as np
    >>> from pflax import data
    >>> labels = np.repeat(np.arange(4), 10)
    >>> part = data.pathological(labels, 2, 2, num_classes=4, seed=0)
    >>> fed = data.federate(np.zeros((40, 3), np.float32), labels, part, seed=0)
    >>> fed.counts.shape, int(fed.num_samples.sum() + fed.test_mask.sum())
    ((2, 4), 40)
    >>> test = (np.ones((8, 3), np.float32), np.repeat(np.arange(4), 2))
    >>> fed = data.federate(np.zeros((40, 3), np.float32), labels, part, seed=0,
    ...                     test=test)
    >>> fed.num_samples.tolist(), fed.test_mask.sum(axis=1).tolist()
    ([20, 20], [4, 4])
  """
  if test is None:
    train, dealt = split_lib.train_test_split(partition, labels, seed=seed,
                                              test_fraction=test_fraction)
    test_images, test_labels = images, labels
  else:
    test_images, test_labels = _test_split(test, np.shape(images)[1:])
    train = partition
    dealt = split_lib.deal_test_split(partition, test_labels, seed=seed)
  tr = clients_lib.stack_clients(images, labels, train.indices,
                                 pad_to_multiple=batch_size)
  te = clients_lib.stack_clients(test_images, test_labels, dealt.indices)
  return Federation(tr.x, tr.y, tr.mask, te.x, te.y, te.mask,
                    np.asarray(train.counts, np.int32), tr.num_samples)


def _pad_axis1(x: np.ndarray, length: int) -> np.ndarray:
  """Zero-pads axis 1 (samples of `(M, L, ...)`, clients of `(S, M, ...)`) to `length`."""
  return np.pad(x, ((0, 0), (0, length - x.shape[1])) + ((0, 0),) * (x.ndim - 2))


def stack_federations(feds: Sequence[Federation]) -> Federation:
  """Stacks federations on a leading run axis, padding samples to common lengths.

  All must have the same clients, classes and input shape; padded samples are
  invalid (`valid` False) and are never trained on nor evaluated.
  """
  train_len = max(f.x.shape[1] for f in feds)
  test_len = max(f.test_x.shape[1] for f in feds)
  pad = lambda f: f._replace(
      x=_pad_axis1(f.x, train_len), y=_pad_axis1(f.y, train_len),
      mask=_pad_axis1(f.mask, train_len), test_x=_pad_axis1(f.test_x, test_len),
      test_y=_pad_axis1(f.test_y, test_len),
      test_mask=_pad_axis1(f.test_mask, test_len))
  return Federation(*(np.stack(xs) for xs in zip(*(pad(f) for f in feds))))


def pad_clients(fed: Federation, multiple: int) -> Federation:
  """Appends empty clients (no samples, zero counts) to run-stacked data `(S, M, ...)`
  up to a multiple of `multiple` clients.

  Padded clients sit on the client axis only so that it divides the devices
  of a mesh: they are never chosen, aggregated nor evaluated.
  """
  m = fed.num_samples.shape[-1]
  return Federation(*(_pad_axis1(x, m + -m % multiple) for x in fed))


def select_clients(fed: Federation, index: np.ndarray) -> Federation:
  """The federation of the clients `index` of run-stacked data `(S, M, ...)`."""
  return Federation(*(x[:, index] for x in fed))
