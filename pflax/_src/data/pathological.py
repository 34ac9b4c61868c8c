"""Pathological label skew: every client holds exactly `c` classes."""

from typing import Literal

import numpy as np
import numpy.typing as npt

from pflax._src.data import _validation
from pflax._src.data import partition as partition_lib


def _deterministic_classes(num_clients: int, per_client: int,
                           num_classes: int) -> np.ndarray:
  """Client `i` gets classes `(i * c + r) mod K` for `r < c`."""
  slots = np.arange(num_clients * per_client).reshape(num_clients, per_client)
  return slots % num_classes


def _random_classes(num_clients: int, per_client: int, num_classes: int,
                    rng: np.random.Generator) -> np.ndarray:
  """A random assignment in which every class is used `floor` or `ceil` of
  `M * c / K` times.

  Random classes receive the `M * c mod K` extra uses; then each client takes the
  `c` classes with the most remaining uses (ties broken at random). Taking the
  largest keeps every remaining quota at most the number of remaining clients, so
  each client always finds `c` distinct classes.
  """
  base, extra = divmod(num_clients * per_client, num_classes)
  quota = np.full(num_classes, base)
  quota[rng.permutation(num_classes)[:extra]] += 1
  classes = np.empty((num_clients, per_client), np.int64)
  for i in range(num_clients):
    chosen = np.lexsort((rng.random(num_classes), -quota))[:per_client]
    classes[i] = np.sort(chosen)
    quota[chosen] -= 1
  return classes


def pathological(
    labels: npt.ArrayLike,
    num_clients: int,
    num_classes_per_partition: int,
    *,
    num_classes: int | None = None,
    class_assignment_mode: Literal["random", "deterministic"] = "random",
    seed: int = 0,
) -> partition_lib.Partition:
  """Partitions samples so every client holds exactly `c` distinct classes.

  Classes are assigned so each is held by `floor(M c / K)` or `ceil(M c / K)`
  clients: in `"deterministic"` mode client `i` holds classes `(i c + r) mod K`,
  `r = 0..c-1`; in `"random"` mode a seeded random assignment with the same
  balance is used. Each class's shuffled samples are then split into near-equal
  parts (sizes differ by at most one) among the clients holding it. Samples of a
  class nobody holds (possible when `M c < K`) are left unassigned.

  Args:
    labels: class label of every sample, integers in `[0, K)`, shape `(N,)`.
    num_clients: number of clients `M >= 1`.
    num_classes_per_partition: `c`, with `1 <= c <= K`.
    num_classes: `K`; defaults to `max(labels) + 1`.
    class_assignment_mode: `"random"` or `"deterministic"`.
    seed: seed of `np.random.default_rng`.

  Returns:
    A `Partition` with `M` sorted index arrays and the `(M, K)` class counts.

  Example:
    >>> labels = np.repeat(np.arange(10), 100)
    >>> part = pathological(labels, 20, 2, class_assignment_mode="deterministic")
    >>> np.flatnonzero(part.counts[3]).tolist(), int(part.counts[3, 6])
    ([6, 7], 25)

  References:
    McMahan et al., "Communication-Efficient Learning of Deep Networks from
    Decentralized Data", AISTATS 2017 (pathological non-IID); Lee and Choi,
    "Class-Wise Federated Averaging for Efficient Personalization" (cwFedAvg),
    Sec. 5 (two classes per client). Argument names follow Flower's
    `PathologicalPartitioner`.

  Raises:
    ValueError: on bad arguments, or if a class has fewer samples than
      `ceil(M c / K)`, the most clients that may hold it.
  """
  labels, num_classes = _validation.labels(labels, num_classes)
  _validation.positive_int(num_clients, "num_clients")
  _validation.positive_int(num_classes_per_partition, "num_classes_per_partition")
  if num_classes_per_partition > num_classes:
    raise ValueError(
        f"num_classes_per_partition must lie in [1, num_classes] = [1, "
        f"{num_classes}], got {num_classes_per_partition}.")
  if class_assignment_mode not in ("random", "deterministic"):
    raise ValueError(
        "class_assignment_mode must be 'random' or 'deterministic', got "
        f"{class_assignment_mode!r}.")
  max_holders = -(-num_clients * num_classes_per_partition // num_classes)
  sizes = np.bincount(labels, minlength=num_classes)
  if sizes.min() < max_holders:
    raise ValueError(
        f"labels: class {int(np.argmin(sizes))} has {sizes.min()} samples, but up to "
        f"ceil(num_clients * num_classes_per_partition / num_classes) = "
        f"{max_holders} clients may hold it.")
  rng = np.random.default_rng(seed)
  if class_assignment_mode == "deterministic":
    classes = _deterministic_classes(num_clients, num_classes_per_partition,
                                     num_classes)
  else:
    classes = _random_classes(num_clients, num_classes_per_partition, num_classes,
                              rng)
  parts = [[] for _ in range(num_clients)]
  for k in range(num_classes):
    holders = np.flatnonzero((classes == k).any(axis=1))
    if holders.size == 0:
      continue
    idx_k = rng.permutation(np.flatnonzero(labels == k))
    for client, chunk in zip(holders, np.array_split(idx_k, holders.size)):
      parts[client].append(chunk)
  return partition_lib.make_partition(
      labels, [np.concatenate(p) for p in parts], num_classes)
