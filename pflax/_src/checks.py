"""Host-side boundary checks for public functions (run before tracing).

Shapes are static even under `jax.jit`, so every shape check here runs at trace
time, before any compiled work. Value checks (non-negative counts, ranges of
hyperparameters) run only when the value is concrete; inside a user's `jit` or a
vmapped sweep they are skipped, never silently coerced.
"""

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pflax._src import types


def is_concrete(x: Any) -> bool:
  """True if `x` holds a value on the host (not a tracer)."""
  return not isinstance(x, jax.core.Tracer)


def _leaf_name(path: jax.tree_util.KeyPath) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/") or "<root>"


def num_clients(stacked: types.Stacked, name: str = "params") -> int:
  """Returns the common leading axis of `stacked`; raises if the leaves disagree."""
  leaves = jax.tree_util.tree_leaves_with_path(stacked)
  if not leaves:
    raise ValueError(f"{name} must be a non-empty pytree of arrays, got {stacked!r}.")
  sizes: dict[int, str] = {}
  for path, leaf in leaves:
    shape = np.shape(leaf)
    if len(shape) == 0:
      raise ValueError(
          f"{name}: every leaf needs a leading client axis M, but leaf "
          f"'{_leaf_name(path)}' is a scalar.")
    sizes.setdefault(shape[0], _leaf_name(path))
  if len(sizes) > 1:
    detail = ", ".join(f"'{leaf}' has M = {m}" for m, leaf in sizes.items())
    raise ValueError(
        f"{name}: all leaves must share the leading client axis M; {detail}.")
  return next(iter(sizes))


def float_leaves(stacked: types.Stacked, name: str = "params") -> None:
  """Raises `TypeError` if a leaf is not a floating-point array."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(stacked):
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
      raise TypeError(
          f"{name}: leaf '{_leaf_name(path)}' has dtype {jnp.result_type(leaf)}; "
          "aggregation needs floating-point leaves.")


def same_structure(a: Any, b: Any, name_a: str, name_b: str) -> None:
  """Raises if two pytrees differ in structure or leaf shapes."""
  sa, sb = jax.tree_util.tree_structure(a), jax.tree_util.tree_structure(b)
  if sa != sb:
    raise ValueError(f"{name_b} must have the same tree structure as {name_a}: "
                     f"{sb} vs {sa}.")
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a),
                          jax.tree_util.tree_leaves(b)):
    if np.shape(x) != np.shape(y):
      raise ValueError(
          f"{name_b}: leaf '{_leaf_name(path)}' must have shape {np.shape(x)} "
          f"like {name_a}, got {np.shape(y)}.")


def shape(x: Any, name: str, expected: Sequence[int], symbols: str) -> None:
  """Raises unless `x` has exactly the shape `expected` (named by `symbols`)."""
  expected = tuple(int(e) for e in expected)
  got = np.shape(x)
  if got != expected:
    raise ValueError(
        f"{name} must have shape {symbols} = {expected}, got {tuple(got)}.")


def non_negative_finite(x: Any, name: str) -> None:
  """Raises if a concrete `x` has negative or non-finite entries."""
  if not is_concrete(x):
    return
  values = np.asarray(x)
  if not np.all(np.isfinite(values)):
    raise ValueError(f"{name} must be finite, got non-finite entries "
                     f"(NaN or inf) at {np.argwhere(~np.isfinite(values)).tolist()[:5]}.")
  if np.any(values < 0):
    raise ValueError(f"{name} must be non-negative, got min {values.min()}.")


def mask(m: Any, num: int, name: str = "mask") -> None:
  """Checks a client mask: shape (M,) and boolean dtype."""
  if m is None:
    return
  shape(m, name, (num,), "(M,)")
  if jnp.result_type(m) != jnp.bool_:
    raise TypeError(f"{name} must be a bool array of shape (M,), "
                    f"got dtype {jnp.result_type(m)}.")


def in_range(x: Any, name: str, low: float | None = None, high: float | None = None,
             *, low_open: bool = False) -> None:
  """Checks a concrete scalar hyperparameter lies in [low, high] (or (low, high])."""
  if np.ndim(x) != 0:
    raise ValueError(f"{name} must be a scalar, got shape {np.shape(x)}.")
  if not is_concrete(x):
    return
  value = float(x)
  too_low = low is not None and (value <= low if low_open else value < low)
  too_high = high is not None and value > high
  if too_low or too_high or np.isnan(value):
    lo = "-inf" if low is None else low
    hi = "inf" if high is None else high
    bracket = "(" if low_open else "["
    raise ValueError(f"{name} must be in {bracket}{lo}, {hi}], got {value}.")


def integer_at_least(x: Any, name: str, low: int) -> None:
  """Checks a static integer argument is a Python int >= low."""
  if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
    raise TypeError(f"{name} must be a Python int, got {type(x).__name__}.")
  if x < low:
    raise ValueError(f"{name} must be >= {low}, got {x}.")
