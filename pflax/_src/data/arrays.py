"""`Dataset`: a labelled dataset in memory, built and validated from arrays."""

from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from pflax._src.data import _validation


class Dataset(NamedTuple):
  """A labelled image dataset held in memory.

  Attributes:
    images: float32 array `(N, H, W, C)` (or `(N, D)` for flat features); the
      loaders scale pixels to `[0, 1]`.
    labels: int32 array `(N,)` with values in `[0, num_classes)`.
    num_classes: `K`.
    name: the name it was loaded under.
    test_images: the dataset's own test split `(T, H, W, C)`, or None when it
      has none (then `images` holds every sample).
    test_labels: int32 array `(T,)`, or None.
  """

  images: np.ndarray
  labels: np.ndarray
  num_classes: int
  name: str
  test_images: np.ndarray | None = None
  test_labels: np.ndarray | None = None


def _images(images: npt.ArrayLike, name: str,
            sample_shape: tuple[int, ...] | None = None) -> np.ndarray:
  """Checks the shape, dtype and values of `images`; returns them as float32."""
  arr = np.asarray(images)
  if arr.ndim == 3:
    raise ValueError(
        f"{name} must have shape (N, H, W, C) or (N, D), got {arr.shape}; for "
        f"one-channel images pass {name}[..., None].")
  if arr.ndim not in (2, 4) or 0 in arr.shape:
    raise ValueError(
        f"{name} must have shape (N, H, W, C) or (N, D) with N >= 1 and no empty "
        f"axis, got {arr.shape}.")
  if sample_shape is not None and arr.shape[1:] != sample_shape:
    raise ValueError(
        f"{name} must have shape (T,) + {sample_shape} (the per-sample shape of "
        f"images), got {arr.shape}.")
  if arr.dtype.kind not in "uif":
    raise ValueError(f"{name} must have an integer or float dtype, got {arr.dtype}.")
  if arr.dtype == np.uint8:
    out = arr.astype(np.float32)
    out /= 255
    return out
  with np.errstate(over="ignore"):  # values beyond float32 become inf, refused below.
    out = arr.astype(np.float32, copy=False)
  if arr.dtype.kind == "f" and not np.isfinite(out).all():
    bad = ~np.isfinite(out).reshape(len(out), -1).all(axis=1)
    raise ValueError(
        f"{name} must be finite (as float32), got NaN or inf in "
        f"{name}[{int(np.flatnonzero(bad)[0])}].")
  return out


def _labels(labels: npt.ArrayLike, name: str, num_samples: int) -> np.ndarray:
  """Checks that `labels` are `(N,)` integers (or integral floats); returns int64."""
  arr = np.asarray(labels)
  if arr.shape != (num_samples,):
    raise ValueError(
        f"{name} must have shape (N,) = ({num_samples},), one per image, got "
        f"{arr.shape}.")
  if arr.dtype.kind == "f":
    integral = np.isfinite(arr) & (arr == np.round(arr))
    if not integral.all():
      first = int(np.flatnonzero(~integral)[0])
      raise ValueError(
          f"{name} must hold integers, got {arr[first].item()!r} in {name}[{first}].")
  elif arr.dtype.kind not in "ui":
    raise ValueError(f"{name} must have an integer dtype, got {arr.dtype}.")
  return arr.astype(np.int64)


def _inferred_classes(labels: np.ndarray, test_labels: np.ndarray | None) -> int:
  """K of labels given without `num_classes`: every class `0..K-1` must have a
  sample (in either split). A label past a class without any sample (one stray
  255 among the digits 0..9) is an error naming its index, not 256 classes."""
  both = labels if test_labels is None else np.concatenate([labels, test_labels])
  if both.min() < 0:
    return 1  # label_range names the first negative label.
  classes = np.unique(both)
  if classes[-1] == len(classes) - 1:
    return len(classes)
  gap = int(np.flatnonzero(classes != np.arange(len(classes)))[0])
  name, split = (("labels", labels) if (labels > gap).any()
                 else ("test_labels", test_labels))
  first = int(np.flatnonzero(split > gap)[0])
  raise ValueError(
      f"{name}[{first}] = {split[first]} lies outside the classes 0..{gap - 1} "
      f"that the labels cover (no sample has label {gap}); declare num_classes "
      f"(e.g. {classes[-1] + 1}) if classes without samples are meant.")


def from_arrays(
    images: npt.ArrayLike,
    labels: npt.ArrayLike,
    *,
    num_classes: int | None = None,
    name: str = "arrays",
    test_images: npt.ArrayLike | None = None,
    test_labels: npt.ArrayLike | None = None,
) -> Dataset:
  """Builds a `Dataset` from arrays, validated once here.

  Images become float32: `uint8` images are divided by 255 (to `[0, 1]`), any
  other integer or float dtype is converted as is. Labels become int32; a float
  array is accepted when every value is an integer (`3.0`).

  Args:
    images: `(N, H, W, C)` images or `(N, D)` feature vectors, N >= 1, finite.
      A 3-D `(N, H, W)` array is refused: add the channel axis, `images[..., None]`.
    labels: `(N,)` class labels in `[0, K)`.
    num_classes: `K`; None uses `max(labels, test_labels) + 1` when every class
      below it has a sample, and refuses labels past a class without one (the
      message names the first); declare `K` to allow classes without samples.
    name: the dataset's name.
    test_images, test_labels: the dataset's own test split, both or neither;
      same per-sample shape as `images`, labels in `[0, K)`.

  Returns:
    The `Dataset`.

  Raises:
    ValueError: an argument has the wrong shape, dtype or values; the message
      names it.

  Example:
    >>> import numpy as np
    >>> ds = from_arrays(np.full((4, 2, 2, 1), 255, np.uint8), [0, 2, 1, 2])
    >>> ds.images.dtype, float(ds.images.max()), ds.labels.dtype, ds.num_classes
    (dtype('float32'), 1.0, dtype('int32'), 3)
    >>> from_arrays(np.zeros((4, 2, 2)), [0, 1, 1, 0])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: images must have shape (N, H, W, C) or (N, D), got (4, 2, 2); ...
  """
  images = _images(images, "images")
  labels = _labels(labels, "labels", len(images))
  if (test_images is None) != (test_labels is None):
    given = "test_images" if test_labels is None else "test_labels"
    raise ValueError(
        f"test_images and test_labels must be given together, got only {given}.")
  if test_images is not None:
    test_images = _images(test_images, "test_images", images.shape[1:])
    test_labels = _labels(test_labels, "test_labels", len(test_images))
  if num_classes is None:
    num_classes = _inferred_classes(labels, test_labels)
  _validation.positive_int(num_classes, "num_classes")
  _validation.label_range(labels, num_classes, "labels")
  if test_labels is not None:
    _validation.label_range(test_labels, num_classes, "test_labels")
    test_labels = test_labels.astype(np.int32)
  if not isinstance(name, str):
    raise ValueError(f"name must be a string, got {name!r}.")
  return Dataset(images, labels.astype(np.int32), int(num_classes), name,
                 test_images, test_labels)


def pooled(dataset: Dataset) -> Dataset:
  """All of a dataset's samples as one pool: its test split appended to `images`.

  The papers' protocol pools every sample, partitions the pool among the
  clients, then splits each client's share 75/25 (`train_test_split`).

  Args:
    dataset: a `Dataset`, with or without a test split.

  Returns:
    The `Dataset` with `images`/`labels` followed by `test_images`/`test_labels`
    and no test split (the same object when it had none).

  Example:
    >>> import numpy as np
    >>> ds = from_arrays(np.zeros((3, 2)), [0, 1, 0], test_images=np.ones((2, 2)),
    ...                  test_labels=[1, 1])
    >>> all_ = pooled(ds)
    >>> all_.images.shape, all_.labels.tolist(), all_.test_images
    ((5, 2), [0, 1, 0, 1, 1], None)
  """
  if dataset.test_images is None:
    return dataset
  return Dataset(np.concatenate([dataset.images, dataset.test_images]),
                 np.concatenate([dataset.labels, dataset.test_labels]),
                 dataset.num_classes, dataset.name)
