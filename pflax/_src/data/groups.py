"""Grouped label skew with an IID fraction (FedPAC / FedReMa benchmark)."""

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from pflax._src.data import _validation
from pflax._src.data import partition as partition_lib

DEFAULT_LABEL_GROUPS = ((0, 1, 2), (2, 3, 4), (4, 5, 6), (6, 7, 8), (8, 9, 0))


def _even(total: int, bins: int, offset: int) -> np.ndarray:
  """`total` split over `bins` as evenly as possible; the `total mod bins` extra
  units go to bins `offset, offset + 1, ...` (cyclically)."""
  base, extra = divmod(total, bins)
  out = np.full(bins, base, np.int64)
  out[(offset + np.arange(extra)) % bins] += 1
  return out


def _quotas(samples_per_client: int, num_clients: int, iid_fraction: float,
            label_groups: Sequence[Sequence[int]], num_classes: int) -> np.ndarray:
  """Per-client, per-class sample quotas `(M, K)` for a given client size `S`.

  Client `i` (group `g = i mod G`) gets `round(s S)` samples spread evenly over
  all `K` classes and the other `S - round(s S)` spread evenly over the group's
  dominant labels. Every quota is non-decreasing in `S`.
  """
  num_groups = len(label_groups)
  num_iid = int(np.floor(iid_fraction * samples_per_client + 0.5))
  quotas = np.zeros((num_clients, num_classes), np.int64)
  for i in range(num_clients):
    group = np.asarray(label_groups[i % num_groups])
    quotas[i] = _even(num_iid, num_classes, i)
    quotas[i, group] += _even(samples_per_client - num_iid, len(group),
                              i // num_groups)
  return quotas


def _largest_feasible(sizes: np.ndarray, num_clients: int, iid_fraction: float,
                      label_groups: Sequence[Sequence[int]]) -> int:
  """Largest `S` whose quotas fit in the class sizes (bisection; monotone)."""
  low, high = 0, int(sizes.sum()) // num_clients
  while low < high:
    mid = (low + high + 1) // 2
    quotas = _quotas(mid, num_clients, iid_fraction, label_groups, len(sizes))
    if np.all(quotas.sum(axis=0) <= sizes):
      low = mid
    else:
      high = mid - 1
  return low


def _check_label_groups(label_groups: Sequence[Sequence[int]],
                        num_classes: int) -> None:
  if len(label_groups) == 0:
    raise ValueError("label_groups must hold at least one group of labels.")
  for g, group in enumerate(label_groups):
    arr = np.asarray(group)
    if (arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer)
        or len(np.unique(arr)) != arr.size or arr.min() < 0
        or arr.max() >= num_classes):
      raise ValueError(
          f"label_groups[{g}] must be a non-empty sequence of distinct labels in "
          f"[0, num_classes) = [0, {num_classes}), got {group!r}.")


def groups(
    labels: npt.ArrayLike,
    num_clients: int,
    *,
    iid_fraction: float = 0.2,
    samples_per_client: int | None = None,
    label_groups: Sequence[Sequence[int]] = DEFAULT_LABEL_GROUPS,
    num_classes: int | None = None,
    seed: int = 0,
) -> partition_lib.Partition:
  """Partitions samples into client groups that share dominant labels.

  Client `i` belongs to group `g = i mod G`, `G = len(label_groups)`. Each client
  holds `S = samples_per_client` samples drawn without replacement from the global
  pool: `round(s S)` of them (`s = iid_fraction`) spread evenly over all `K`
  labels, the other `S - round(s S)` spread evenly over the group's dominant
  labels `label_groups[g]`. When `S` is not divisible, the extra samples go to
  labels that rotate with the client index. Samples nobody draws stay unassigned.

  Args:
    labels: class label of every sample, integers in `[0, K)`, shape `(N,)`.
    num_clients: number of clients `M >= 1`.
    iid_fraction: `s` in `[0, 1]`, the share of each client's samples spread over
      all labels.
    samples_per_client: `S >= 1`. Defaults to the largest `S` for which every
      class has enough samples for all clients' quotas.
    label_groups: dominant labels of each group (defaults to FedReMa's five
      overlapping triples for 10 classes).
    num_classes: `K`; defaults to `max(labels) + 1`.
    seed: seed of `np.random.default_rng`.

  Returns:
    A `Partition` with `M` sorted index arrays and the `(M, K)` class counts.

  Example:
    >>> labels = np.repeat(np.arange(10), 100)
    >>> part = groups(labels, 10, iid_fraction=0.2, samples_per_client=50)
    >>> part.counts[0].tolist()  # group (0, 1, 2): 10 IID + 40 dominant
    [15, 14, 14, 1, 1, 1, 1, 1, 1, 1]

  References:
    Liang et al., "FedReMa: Improving Personalized Federated Learning via
    Leveraging the Most Relevant Clients", ECAI 2024 (Sec. 5.1); Xu et al.,
    "Personalized Federated Learning with Feature Alignment and Classifier
    Collaboration" (FedPAC), ICLR 2023.

  Raises:
    ValueError: on bad arguments, or if the class sizes cannot cover the quotas
      of an explicit `samples_per_client` (the message gives the largest feasible
      value).
  """
  labels, num_classes = _validation.labels(labels, num_classes)
  _validation.positive_int(num_clients, "num_clients")
  _validation.fraction(iid_fraction, "iid_fraction", open_interval=False)
  _check_label_groups(label_groups, num_classes)
  sizes = np.bincount(labels, minlength=num_classes)
  largest = _largest_feasible(sizes, num_clients, iid_fraction, label_groups)
  if samples_per_client is None:
    if largest == 0:
      raise ValueError(
          f"labels: {len(labels)} samples are too few for num_clients="
          f"{num_clients} with these label_groups; no samples_per_client >= 1 fits.")
    samples_per_client = largest
  _validation.positive_int(samples_per_client, "samples_per_client")
  if samples_per_client > largest:
    raise ValueError(
        f"samples_per_client={samples_per_client} is infeasible: some class has too "
        f"few samples for all {num_clients} clients' quotas; the largest feasible "
        f"value is {largest}.")
  quotas = _quotas(samples_per_client, num_clients, iid_fraction, label_groups,
                   num_classes)
  rng = np.random.default_rng(seed)
  parts = [[] for _ in range(num_clients)]
  for k in range(num_classes):
    idx_k = rng.permutation(np.flatnonzero(labels == k))
    chunks = np.split(idx_k, np.cumsum(quotas[:, k]))[:-1]  # last: unassigned
    for part, chunk in zip(parts, chunks):
      part.append(chunk)
  return partition_lib.make_partition(
      labels, [np.concatenate(p) for p in parts], num_classes)
