"""Boundary checks shared by the partitioners (NumPy, host side).

Each check raises a `ValueError` that names the offending argument; the functions
behind the public boundary trust their inputs.
"""

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


def labels(labels: npt.ArrayLike, num_classes: int | None, *,
           name: str = "labels") -> tuple[np.ndarray, int]:
  """Returns `(labels as int64, K)` after checking they are 1-D ints in [0, K).

  Args:
    labels: class label of every sample, shape `(N,)`.
    num_classes: `K`, or None to use `max(labels) + 1`.
    name: argument name used in error messages.

  Returns:
    The labels as an int64 array and the number of classes `K`.
  """
  arr = np.asarray(labels)
  if arr.ndim != 1 or arr.size == 0:
    raise ValueError(
        f"{name} must be a non-empty 1-D array of shape (N,), got shape {arr.shape}.")
  if not np.issubdtype(arr.dtype, np.integer):
    raise ValueError(f"{name} must have an integer dtype, got {arr.dtype}.")
  if num_classes is None:
    num_classes = max(int(arr.max()) + 1, 1)
  positive_int(num_classes, "num_classes")
  label_range(arr, num_classes, name)
  return arr.astype(np.int64), int(num_classes)


def label_range(labels: np.ndarray, num_classes: int, name: str) -> None:
  """Raises unless the non-empty integer array `labels` lies in `[0, num_classes)`."""
  outside = (labels < 0) | (labels >= num_classes)
  if outside.any():
    first = int(np.flatnonzero(outside)[0])
    raise ValueError(
        f"{name} must lie in [0, num_classes) = [0, {num_classes}), got values in "
        f"[{labels.min()}, {labels.max()}]; the first outside is {name}[{first}] = "
        f"{labels[first]}.")


def positive_int(value: int, name: str) -> None:
  """Raises unless `value` is an integer >= 1."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")


def non_negative_int(value: int, name: str) -> None:
  """Raises unless `value` is an integer >= 0."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
    raise ValueError(f"{name} must be an integer >= 0, got {value!r}.")


def fraction(value: float, name: str, *, open_interval: bool) -> None:
  """Raises unless `value` lies in (0, 1) (if `open_interval`) or in [0, 1]."""
  ok = 0 < value < 1 if open_interval else 0 <= value <= 1
  if not ok:
    interval = "(0, 1)" if open_interval else "[0, 1]"
    raise ValueError(f"{name} must lie in {interval}, got {value!r}.")


def indices(indices: Sequence[npt.ArrayLike], num_samples: int,
            name: str) -> list[np.ndarray]:
  """Returns per-client index arrays after checking they are 1-D ints in [0, N).

  Args:
    indices: one array of sample indices per client.
    num_samples: `N`, the number of samples the indices refer to.
    name: argument name used in error messages.

  Returns:
    The index arrays as int64 arrays.
  """
  if len(indices) == 0:
    raise ValueError(f"{name} must hold one index array per client, got none.")
  out = []
  for i, idx in enumerate(indices):
    arr = np.asarray(idx)
    if arr.size == 0:
      arr = arr.astype(np.int64).reshape(0)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(
          f"{name}[{i}] must be a 1-D integer array, got shape {arr.shape} and "
          f"dtype {arr.dtype}.")
    if arr.size and (arr.min() < 0 or arr.max() >= num_samples):
      raise ValueError(
          f"{name}[{i}] must index samples in [0, {num_samples}), got values in "
          f"[{arr.min()}, {arr.max()}].")
    out.append(arr.astype(np.int64))
  return out
