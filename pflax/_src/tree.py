"""Stacked-pytree plumbing: every leaf carries a leading client axis M.

Mixing is the one primitive all aggregators share: `out[o] = sum_m w[o, m] x[m]`,
computed per leaf as a single `tensordot` over the client axis (on XLA-CPU a
reduction over axis 0 is much slower than a dot), accumulated in float32 (or the
leaf's dtype if wider) and returned in the leaf's dtype.
"""

from collections.abc import Callable, Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

from pflax._src import checks
from pflax._src import types

_HIGHEST = jax.lax.Precision.HIGHEST
_GRAM_BLOCK = 4096


def stack(trees: Sequence[types.Tree]) -> types.Stacked:
  """Stacks trees of identical structure on a new leading client axis.

  Args:
    trees: a non-empty sequence of pytrees with the same structure and shapes.

  Returns:
    A stacked pytree whose leaves have shape `(len(trees), ...)`.

  Example:
    >>> stacked = stack([{"w": jnp.zeros(3)}, {"w": jnp.ones(3)}])
    >>> stacked["w"].shape
    (2, 3)
  """
  if not trees:
    raise ValueError("trees must be a non-empty sequence of pytrees.")
  for i, tree in enumerate(trees[1:], start=1):
    checks.same_structure(trees[0], tree, "trees[0]", f"trees[{i}]")
  return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def unstack(stacked: types.Stacked) -> list[types.Tree]:
  """Splits a stacked pytree into a list of M trees (inverse of `stack`)."""
  m = checks.num_clients(stacked, "stacked")
  return [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(m)]


def num_clients(stacked: types.Stacked) -> int:
  """Returns M, the leading size shared by every leaf; `ValueError` if they differ."""
  return checks.num_clients(stacked, "stacked")


def broadcast(tree: types.Tree, num_clients: int) -> types.Stacked:
  """Returns a stacked pytree holding `num_clients` copies of `tree`."""
  checks.integer_at_least(num_clients, "num_clients", 1)
  return jax.tree.map(
      lambda x: jnp.broadcast_to(x, (num_clients,) + jnp.shape(x)), tree)


def accumulation_dtype(dtype: Any) -> jnp.dtype:
  """float32, or `dtype` itself if it is a wider float."""
  return jnp.promote_types(dtype, jnp.float32)


def mix_leaf(weights: chex.Array, leaf: chex.Array) -> chex.Array:
  """`out[o] = sum_m weights[o, m] leaf[m]` for one leaf (no checks)."""
  acc = accumulation_dtype(leaf.dtype)
  flat = leaf.reshape(leaf.shape[0], -1).astype(acc)
  out = jnp.tensordot(weights.astype(acc), flat, 1, precision=_HIGHEST)
  return out.reshape((weights.shape[0],) + leaf.shape[1:]).astype(leaf.dtype)


def mix_factored_leaf(left: chex.Array, right: chex.Array,
                      leaf: chex.Array) -> chex.Array:
  """`(left @ right) @ leaf` in whichever order costs fewer multiply-adds.

  For `left (O, R)`, `right (R, M)` and a leaf of `n` entries per client, the
  factored order costs `(R M + O R) n`, the dense one `O R M + O M n`.
  """
  (o, r), m = left.shape, right.shape[1]
  n = int(np.prod(leaf.shape[1:], dtype=np.int64))
  if (r * m + o * r) * n < o * r * m + o * m * n:
    inner = mix_leaf(right, leaf.astype(accumulation_dtype(leaf.dtype)))
    return mix_leaf(left, inner).astype(leaf.dtype)  # no rounding in between
  return mix_leaf(jnp.matmul(left, right, precision=_HIGHEST), leaf)


def mix(weights: chex.Array, stacked: types.Stacked) -> types.Stacked:
  """Mixes clients: `out[o] = sum_m weights[o, m] * stacked[m]`.

  Args:
    weights: `(O, M)` mixing matrix.
    stacked: stacked pytree with M clients.

  Returns:
    A stacked pytree with O entries on the leading axis, in the input dtypes.

  Example:
    >>> x = {"w": jnp.array([[1.0], [3.0]])}
    >>> mix(jnp.array([[0.5, 0.5]]), x)["w"]
    Array([[2.]], dtype=float32)
  """
  m = checks.num_clients(stacked, "stacked")
  if np.ndim(weights) != 2 or np.shape(weights)[1] != m:
    raise ValueError(f"weights must have shape (O, M) with M = {m}, "
                     f"got {np.shape(weights)}.")
  weights = jnp.asarray(weights)
  return jax.tree.map(lambda x: mix_leaf(weights, x), stacked)


def normalize(weights: chex.Array) -> chex.Array:
  """Divides non-negative weights by their sum along the last axis."""
  weights = jnp.asarray(weights, jnp.float32)
  return weights / jnp.sum(weights, axis=-1, keepdims=True)


def weighted_mean(stacked: types.Stacked,
                  weights: chex.Array | None = None) -> types.Tree:
  """`sum_i w_i x_i / sum_i w_i` over the client axis; uniform if `weights` is None.

  Args:
    stacked: stacked pytree with M clients.
    weights: optional non-negative `(M,)` weights (e.g. sample counts).

  Returns:
    A tree without the client axis.
  """
  m = checks.num_clients(stacked, "stacked")
  if weights is None:
    weights = jnp.ones((m,), jnp.float32)
  checks.shape(weights, "weights", (m,), "(M,)")
  checks.non_negative_finite(weights, "weights")
  row = normalize(weights)[None]
  return jax.tree.map(lambda x: mix_leaf(row, x)[0], stacked)


def _gram_leaf(x: chex.Array, offset: chex.Array | None) -> chex.Array:
  """`d d^T` of one leaf, `d = x - offset` flattened to `(M, n)`, block by block.

  Blocks of `_GRAM_BLOCK` positions: the difference is never materialised, and
  on XLA-CPU many cache-sized dots run about twice as fast as one long one.
  """
  m = x.shape[0]
  x = jnp.reshape(x, (m, -1))
  offset = None if offset is None else jnp.reshape(offset, (m, -1))

  def block(start: Any, size: int) -> chex.Array:
    d = jax.lax.dynamic_slice_in_dim(x, start, size, 1)
    if offset is not None:
      d = d - jax.lax.dynamic_slice_in_dim(offset, start, size, 1)
    d = d.astype(accumulation_dtype(d.dtype))
    return jax.lax.dot_general(d, d, (((1,), (1,)), ((), ())), precision=_HIGHEST)

  count, rest = divmod(x.shape[1], _GRAM_BLOCK)
  g = jnp.zeros((m, m), accumulation_dtype(
      x.dtype if offset is None else jnp.result_type(x, offset)))
  if count:
    g = jax.lax.fori_loop(0, count,
                          lambda i, g: g + block(i * _GRAM_BLOCK, _GRAM_BLOCK), g)
  if rest:
    g = g + block(count * _GRAM_BLOCK, rest)
  return g


def gram(stacked: types.Stacked, offset: types.Stacked | None = None) -> chex.Array:
  """`(M, M)` inner products of clients' flattened `stacked - offset`, leaf by leaf.

  `offset` (same structure, or None for zero) is subtracted block by block, so
  e.g. the Gram of model updates never materialises the updates.
  """
  offsets = ([None] * len(jax.tree.leaves(stacked)) if offset is None
             else jax.tree.leaves(offset))
  grams = [_gram_leaf(x, o) for x, o in zip(jax.tree.leaves(stacked), offsets)]
  return sum(grams[1:], grams[0])


def cosine_from_gram(g: chex.Array, eps: float = 1e-12) -> chex.Array:
  """Cosines from a Gram matrix; pairs involving a zero vector get cosine 0.

  The square root is guarded so a zero vector has a finite (zero) gradient.
  """
  sq = jnp.diagonal(g)
  positive = sq > 0
  norms = jnp.where(positive, jnp.sqrt(jnp.where(positive, sq, 1.0)), 0.0)
  denom = norms[:, None] * norms[None, :]
  safe = denom > eps
  return jnp.where(safe, g / jnp.where(safe, denom, 1.0), 0.0)


def cosine_similarity(stacked: types.Stacked, eps: float = 1e-12) -> chex.Array:
  """`(M, M)` cosine similarities between clients' flattened parameter vectors.

  Computed as a sum of per-leaf Gram matrices, never concatenating the model. A
  client whose vector has norm 0 has cosine 0 with every client (itself too).

  Args:
    stacked: stacked pytree with M clients.
    eps: products of norms at or below `eps` give cosine 0.

  Returns:
    A float32 `(M, M)` matrix.
  """
  checks.num_clients(stacked, "stacked")
  return cosine_from_gram(gram(stacked), eps)


def finite_clients(stacked: types.Stacked) -> chex.Array:
  """Bool `(M,)`: True for clients whose every leaf entry is finite."""
  m = checks.num_clients(stacked, "stacked")
  flags = [jnp.all(jnp.isfinite(x.reshape(m, -1)), axis=1)
           for x in jax.tree.leaves(stacked)]
  return jnp.stack(flags).all(axis=0)


def concat(stacked_list: Sequence[types.Stacked]) -> types.Stacked:
  """Joins stacked pytrees of one structure along the client axis."""
  if not stacked_list:
    raise ValueError("stacked_list must be a non-empty sequence.")
  first = jax.tree_util.tree_structure(stacked_list[0])
  for i, s in enumerate(stacked_list):
    checks.num_clients(s, f"stacked_list[{i}]")
    if jax.tree_util.tree_structure(s) != first:
      raise ValueError(f"stacked_list[{i}] has a different tree structure from "
                       "stacked_list[0].")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(stacked_list[0]),
                            jax.tree.leaves(s)):
      if jnp.shape(a)[1:] != jnp.shape(b)[1:]:
        raise ValueError(
            f"stacked_list[{i}]: leaf '{jax.tree_util.keystr(path)}' has per-client "
            f"shape {jnp.shape(b)[1:]}, expected {jnp.shape(a)[1:]}.")
  return jax.tree.map(lambda *xs: jnp.concatenate(xs), *stacked_list)


def path_names(path: jax.tree_util.KeyPath) -> tuple[str, ...]:
  """Key path as a tuple of strings (dict keys, attribute names, indices)."""
  names = []
  for entry in path:
    if isinstance(entry, jax.tree_util.DictKey):
      names.append(str(entry.key))
    elif isinstance(entry, jax.tree_util.GetAttrKey):
      names.append(entry.name)
    elif isinstance(entry, jax.tree_util.SequenceKey):
      names.append(str(entry.idx))
    else:
      names.append(str(getattr(entry, "key", entry)))
  return tuple(names)


def under(*names: str) -> Callable[[tuple[str, ...], Any], bool]:
  """Selector true for leaves whose path contains `names` as consecutive modules.

  Example:
    >>> params = {"features": {"w": 1.0}, "classifier": {"output": {"b": 2.0}}}
    >>> partition(params, under("classifier"))[0]
    {'classifier': {'output': {'b': 2.0}}, 'features': {'w': None}}
  """
  if not names or not all(isinstance(n, str) for n in names):
    raise ValueError(f"under needs one or more module names, got {names!r}.")
  k = len(names)

  def select(path: tuple[str, ...], leaf: Any) -> bool:
    del leaf
    return any(tuple(path[i:i + k]) == names for i in range(len(path) - k + 1))

  select.__name__ = f"under{names!r}"
  return select


def selection(tree: Any, where: types.Selector | None) -> list[bool]:
  """Resolves a selector to one static bool per leaf (None selects all)."""
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  if where is None:
    return [True] * len(leaves)
  if callable(where):
    return [bool(where(path_names(path), leaf)) for path, leaf in leaves]
  flags = jax.tree_util.tree_leaves(where)
  if jax.tree_util.tree_structure(where) != jax.tree_util.tree_structure(tree):
    raise ValueError("where must be a callable (path, leaf) -> bool or a pytree of "
                     "bools with the same structure as the parameters.")
  return [bool(f) for f in flags]


def partition(tree: Any, where: types.Selector) -> tuple[Any, Any]:
  """Splits a tree by a selector into `(selected, rest)`, with None placeholders.

  Both halves keep the full structure; a leaf appears in exactly one of them and
  is `None` in the other, so `jax.tree.map` over either touches only its leaves.
  """
  flags = iter(selection(tree, where))
  marked = jax.tree.map(lambda x: (next(flags), x), tree)
  is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], bool)
  selected = jax.tree.map(lambda p: p[1] if p[0] else None, marked, is_leaf=is_pair)
  rest = jax.tree.map(lambda p: None if p[0] else p[1], marked, is_leaf=is_pair)
  return selected, rest


def combine(selected: Any, rest: Any) -> Any:
  """Re-joins the two halves of `partition` into one tree."""
  return jax.tree.map(lambda a, b: b if a is None else a, selected, rest,
                      is_leaf=lambda x: x is None)


def map_selected(on_selected: Callable[[chex.Array], chex.Array],
                 on_rest: Callable[[chex.Array], chex.Array],
                 tree: Any, flags: Sequence[bool]) -> Any:
  """Applies `on_selected` to leaves flagged True and `on_rest` to the others."""
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(
      treedef, [on_selected(x) if f else on_rest(x) for x, f in zip(leaves, flags)])


def broadcast_leaf(row: chex.Array, num_clients: int) -> chex.Array:
  """`num_clients` copies of one leaf along a new leading axis."""
  return jnp.broadcast_to(row, (num_clients,) + row.shape)
