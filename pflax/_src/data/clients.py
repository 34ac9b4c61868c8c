"""Client datasets padded to a common length, stacked for `jax.vmap`."""

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from pflax._src.data import _validation


class StackedClients(NamedTuple):
  """Samples of `M` clients padded to a common length `L`.

  Attributes:
    x: float32 inputs of shape `(M, L, ...)`; zeros where `mask` is False.
    y: int32 labels of shape `(M, L)`; zeros where `mask` is False.
    mask: bool array `(M, L)`, True on real samples (the first `num_samples[i]`).
    num_samples: int32 array `(M,)`, the number of real samples per client.
  """

  x: np.ndarray
  y: np.ndarray
  mask: np.ndarray
  num_samples: np.ndarray


def stack_clients(
    images: npt.ArrayLike,
    labels: npt.ArrayLike,
    indices: Sequence[npt.ArrayLike],
    *,
    pad_to_multiple: int = 1,
) -> StackedClients:
  """Gathers each client's samples and zero-pads them to a common length.

  `L = ceil(max_i n_i / pad_to_multiple) * pad_to_multiple`, so with
  `pad_to_multiple` equal to the batch size every client splits into whole
  batches. Client `i`'s samples appear in the order of `indices[i]`.

  Args:
    images: inputs of shape `(N, ...)`.
    labels: integer labels of shape `(N,)`.
    indices: one array of sample indices per client (e.g. `Partition.indices`).
    pad_to_multiple: `L` is rounded up to a multiple of this (>= 1).

  Returns:
    A `StackedClients` of NumPy arrays.

  Example:
    >>> data = stack_clients(np.ones((5, 2)), np.arange(5), [[0, 1, 2], [4]],
    ...                      pad_to_multiple=2)
    >>> data.x.shape, data.mask.tolist(), data.num_samples.tolist()
    ((2, 4, 2), [[True, True, True, False], [True, False, False, False]], [3, 1])
  """
  images = np.asarray(images)
  labels = np.asarray(labels)
  if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
    raise ValueError(
        f"labels must be a 1-D integer array of shape (N,), got shape {labels.shape} "
        f"and dtype {labels.dtype}.")
  if images.ndim < 1 or images.shape[0] != labels.shape[0]:
    raise ValueError(
        f"images must have shape (N, ...) with N = len(labels) = {labels.shape[0]}, "
        f"got {images.shape}.")
  _validation.positive_int(pad_to_multiple, "pad_to_multiple")
  indices = _validation.indices(indices, labels.shape[0], "indices")
  num_samples = np.array([len(idx) for idx in indices], np.int32)
  length = -(-int(num_samples.max()) // pad_to_multiple) * pad_to_multiple
  x = np.zeros((len(indices), length) + images.shape[1:], np.float32)
  y = np.zeros((len(indices), length), np.int32)
  for i, idx in enumerate(indices):
    x[i, :len(idx)] = images[idx]
    y[i, :len(idx)] = labels[idx]
  mask = np.arange(length) < num_samples[:, None]
  return StackedClients(x, y, mask, num_samples)
