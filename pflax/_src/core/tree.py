"""Stacked-pytree plumbing: every leaf carries a leading client axis M.

Mixing is the one primitive all aggregators share: `out[o] = sum_m w[o, m] x[m]`,
computed per leaf as a single `tensordot` over the client axis (on XLA-CPU a
reduction over axis 0 is much slower than a dot), accumulated in float32 (or the
leaf's dtype if wider) and returned in the leaf's dtype.

Public functions check their inputs on the host, then run one module-level
jitted program, so an eager call costs one dispatch (not one per primitive);
inside a caller's `jit`, `vmap` or `grad` the inner jit is inlined.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

from pflax._src.core import checks
from pflax._src.core import numerics
from pflax._src.core import types

_HIGHEST = jax.lax.Precision.HIGHEST
_GRAM_BLOCK_ENTRIES = 2 ** 18   # per block, over all clients (1 MiB of float32)


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


def mix_leaf(weights: chex.Array, leaf: chex.Array) -> chex.Array:
  """`out[o] = sum_m weights[o, m] leaf[m]` for one leaf (no checks)."""
  acc = numerics.accumulation_dtype(leaf.dtype)
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
    inner = mix_leaf(right, leaf.astype(numerics.accumulation_dtype(leaf.dtype)))
    return mix_leaf(left, inner).astype(leaf.dtype)  # no rounding in between
  return mix_leaf(jnp.matmul(left, right, precision=_HIGHEST), leaf)


@jax.jit
def _mix(weights: chex.Array, stacked: types.Stacked) -> types.Stacked:
  return jax.tree.map(lambda x: mix_leaf(weights, x), stacked)


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
  m = checks.stacked_clients(stacked, "stacked")
  if np.ndim(weights) != 2 or np.shape(weights)[1] != m:
    raise ValueError(f"weights must have shape (O, M) with M = {m}, "
                     f"got {np.shape(weights)}.")
  return _mix(jnp.asarray(weights), stacked)


@jax.jit
def _weighted_mean(stacked: types.Stacked, weights: chex.Array) -> types.Tree:
  row = numerics.normalize(weights, numerics.weight_dtype(stacked))[None]
  return jax.tree.map(lambda x: mix_leaf(row, x)[0], stacked)


def weighted_mean(stacked: types.Stacked,
                  weights: chex.Array | None = None) -> types.Tree:
  """`sum_i w_i x_i / sum_i w_i` over the client axis; uniform if `weights` is None.

  Args:
    stacked: stacked pytree with M clients.
    weights: optional non-negative `(M,)` weights (e.g. sample counts); at
      least one must be positive.

  Returns:
    A tree without the client axis, in the input dtypes.

  Notes:
    Weights are normalised in float32 (float64 for float64 leaves) after
    scaling by a power of two near their maximum, so counts near the dtype's
    maximum are fine.
    All-zero concrete weights raise `ValueError`; traced all-zero weights
    (inside `jit`) give a tree of zeros.
  """
  m = checks.stacked_clients(stacked, "stacked")
  if weights is None:
    weights = jnp.ones((m,), jnp.float32)
  checks.shape(weights, "weights", (m,), "(M,)")
  checks.non_negative_finite(weights, "weights")
  checks.some_weight(weights, None, "weights")
  return _weighted_mean(stacked, jnp.asarray(weights))


def _add_leaf_gram(carry: tuple[chex.Array, chex.Array], x: chex.Array,
                   offset: chex.Array | None) -> tuple[chex.Array, chex.Array]:
  """Adds one leaf's `d d^T`, `d = x - offset` flattened to `(M, n)`, to `carry`.

  `carry = (g, e)` is a Gram matrix of the rows `d_i / 2^e_i`. Cache-sized
  blocks (about `_GRAM_BLOCK_ENTRIES` entries, at least 4096 positions): the
  difference is never materialised (on XLA-CPU many cache-sized dots run about
  twice as fast as one long one), and each block raises `e_i` to its largest
  entry's exponent, rescaling `g` by exact powers of two, so no product
  overflows or underflows.
  """
  m = x.shape[0]
  size = max(4096, 2 ** int(np.log2(max(_GRAM_BLOCK_ENTRIES // m, 1))))
  x = jnp.reshape(x, (m, -1))
  offset = None if offset is None else jnp.reshape(offset, (m, -1))
  acc = carry[0].dtype

  def block(start: Any, width: int,
            carry: tuple[chex.Array, chex.Array]) -> tuple[chex.Array, chex.Array]:
    g, e = carry
    d = jax.lax.dynamic_slice_in_dim(x, start, width, 1).astype(acc)
    if offset is not None:  # subtracted in `acc`: float16 differences can overflow
      d = d - jax.lax.dynamic_slice_in_dim(offset, start, width, 1).astype(acc)
    top = jax.lax.stop_gradient(jnp.max(jnp.abs(d), axis=1))
    new = jnp.maximum(e, numerics.scale_exponent(top))
    shrink = numerics.power_of_two(e - new, acc)
    d = d * numerics.power_of_two(-new, acc)[:, None]
    dd = jax.lax.dot_general(d, d, (((1,), (1,)), ((), ())), precision=_HIGHEST)
    return g * shrink[:, None] * shrink[None, :] + dd, new

  count, rest = divmod(x.shape[1], size)
  if count:
    carry = jax.lax.fori_loop(0, count, lambda i, c: block(i * size, size, c), carry)
  if rest:
    carry = block(count * size, rest, carry)
  return carry


def scaled_gram(stacked: types.Stacked,
                offset: types.Stacked | None = None) -> tuple[chex.Array, chex.Array]:
  """Gram matrix of clients' flattened `stacked - offset`, rows scaled by powers of 2.

  Returns `(g, e)`: `g[i, j] = <d_i, d_j> / 2^(e_i + e_j)` with `2^e_i` about
  client i's largest `|d_i|` entry, so `g`'s entries stay within
  `[-n, n]` for n positions whatever the magnitudes (updates of 1e20 or 1e-30
  alike; subnormal entries count as 0, as XLA-CPU flushes them); cosines
  from `g` equal those of the plain Gram. `offset` (same
  structure, or None for zero) is subtracted block by block, in float32 (or the
  leaves' dtype if wider), so e.g. the Gram of model updates never materialises
  the updates. The scaling is by exact powers of two, so it adds no rounding:
  for moderate magnitudes `g * 2^(e_i + e_j)` is the unscaled blocked Gram
  bit for bit.
  """
  xs = jax.tree.leaves(stacked)
  offsets = [None] * len(xs) if offset is None else jax.tree.leaves(offset)
  acc = numerics.accumulation_dtype(
      jnp.result_type(*xs, *[o for o in offsets if o is not None]))
  m = xs[0].shape[0]
  carry = (jnp.zeros((m, m), acc),
           numerics.scale_exponent(jnp.zeros((m,), acc)))  # the lowest exponent
  for x, o in zip(xs, offsets):
    carry = _add_leaf_gram(carry, x, o)
  return carry


def cosine_from_gram(g: chex.Array, eps: chex.Numeric = 1e-12,
                     exponents: chex.Array | None = None) -> chex.Array:
  """Cosines from a Gram matrix; pairs involving a zero vector get cosine 0.

  `g` may be scaled as by `scaled_gram` (true norms `sqrt(g_ii) 2^e_i` with
  `exponents` e, zero if None): a pair whose true norms multiply to at most
  `eps` gets cosine 0, as does a vector with a non-finite norm. The square root
  is guarded so a zero vector has a finite (zero) gradient.
  """
  sq = jnp.diagonal(g)
  positive = sq > 0
  norms = jnp.where(positive, jnp.sqrt(jnp.where(positive, sq, 1.0)), 0.0)
  log_norms = jnp.log2(jnp.where(positive, norms, 1.0))
  if exponents is not None:
    log_norms = log_norms + exponents
  log_norms = jnp.where(positive, log_norms, -jnp.inf)
  denom = norms[:, None] * norms[None, :]
  safe = (log_norms[:, None] + log_norms[None, :] > jnp.log2(eps)) & (denom > 0)
  return jnp.where(safe, g / jnp.where(safe, denom, 1.0), 0.0)


@jax.jit
def _cosine_similarity(stacked: types.Stacked, eps: chex.Numeric) -> chex.Array:
  g, exponents = scaled_gram(stacked)
  return cosine_from_gram(g, eps, exponents)


def cosine_similarity(stacked: types.Stacked, eps: chex.Numeric = 1e-12) -> chex.Array:
  """`(M, M)` cosine similarities between clients' flattened parameter vectors.

  Computed as a sum of per-leaf Gram matrices, never concatenating the model,
  with each client's vector scaled by a power of two near its largest entry, so
  no product overflows (vectors of 1e30) or underflows (1e-30); small vectors
  get cosine 0 only through `eps`. A client whose vector has norm 0 has cosine
  0 with every client (itself too).

  Args:
    stacked: stacked pytree with M clients.
    eps: pairs whose norms multiply to at most `eps` get cosine 0.

  Returns:
    A float32 `(M, M)` matrix (float64 for float64 leaves).
  """
  checks.stacked_clients(stacked, "stacked")
  return _cosine_similarity(stacked, eps)


@jax.jit
def _finite_clients(stacked: types.Stacked) -> chex.Array:
  m = jax.tree.leaves(stacked)[0].shape[0]
  flags = [jnp.all(jnp.isfinite(x.reshape(m, -1)), axis=1)
           for x in jax.tree.leaves(stacked)]
  return jnp.stack(flags).all(axis=0)


def finite_clients(stacked: types.Stacked) -> chex.Array:
  """Bool `(M,)`: True for clients whose every leaf entry is finite."""
  checks.stacked_clients(stacked, "stacked")
  return _finite_clients(stacked)


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


@dataclasses.dataclass(frozen=True)
class Under:
  """The selector of `under(*names)`: compares and hashes by its names, so a
  configuration that holds one (e.g. `pflax.models.Parts`) compiles once."""
  names: tuple[str, ...]

  def __call__(self, path: tuple[str, ...], leaf: Any) -> bool:
    del leaf
    k = len(self.names)
    return any(tuple(path[i:i + k]) == self.names for i in range(len(path) - k + 1))

  def __repr__(self) -> str:
    return f"pflax.tree.under{self.names!r}"


def under(*names: str) -> Under:
  """Selector true for leaves whose path contains `names` as consecutive modules.

  Example:
    >>> params = {"features": {"w": 1.0}, "classifier": {"output": {"b": 2.0}}}
    >>> partition(params, under("classifier"))[0]
    {'classifier': {'output': {'b': 2.0}}, 'features': {'w': None}}
    >>> under("Dense_2") == under("Dense_2")
    True
  """
  if not names or not all(isinstance(n, str) for n in names):
    raise ValueError(f"under needs one or more module names, got {names!r}.")
  return Under(tuple(names))


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


def top_level_keys(tree: Any) -> str:
  """The tree's top-level keys, and the keys inside a single one (Flax's "params")."""
  paths = [path_names(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
  top = list(dict.fromkeys(p[0] for p in paths if p))
  text = f"top-level keys: {top}"
  if len(top) == 1:
    inner = list(dict.fromkeys(p[1] for p in paths if len(p) > 1))
    if inner:
      text += f", inside {top[0]!r}: {inner}"
  return text


def required_selection(tree: Any, where: types.Selector | None,
                       name: str = "where") -> list[bool]:
  """Like `selection`, but a `where` (not None) that selects no leaf is an error.

  A selector that matches nothing (a typo, or module names of another model)
  would silently turn a layer-wise method into plain FedAvg or into a no-op.
  The `ValueError` names `name` and lists the tree's top-level keys.
  """
  flags = selection(tree, where)
  if where is not None and not any(flags):
    raise ValueError(
        f"{name} selects no leaf of the parameters ({top_level_keys(tree)}). "
        "Selectors such as pflax.tree.under(...) match module names anywhere in "
        "a leaf's path.")
  return flags


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


def partition_flags(tree: Any, flags: Sequence[bool]) -> tuple[Any, Any]:
  """`partition` by one bool per leaf, as `selection` resolves a selector.

  For jitted code that takes the selection as a static tuple of flags (a
  selector need not be hashable).
  """
  return partition(tree, jax.tree.unflatten(jax.tree.structure(tree), list(flags)))


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


def _prune(tree: Any) -> Any:
  """A nested dict without its None leaves and emptied branches (None if empty)."""
  if not isinstance(tree, dict):
    return tree
  kept = {k: v for k, v in ((k, _prune(v)) for k, v in tree.items()) if v is not None}
  return kept or None


def selected(tree: Any, where: types.Selector) -> Any:
  """The leaves `where` selects, as a nested dict of those leaves only.

  Unlike `partition`'s halves, the result does not depend on the unselected
  layers, so models of different architectures that share the selected
  layers give trees of one structure.
  """
  return _prune(partition(tree, where)[0])


def with_selected(tree: Any, where: types.Selector, replacement: Any) -> Any:
  """`tree` with the leaves `where` selects taken from `replacement` (`selected`)."""
  flags = iter(selection(tree, where))

  def pick(path, leaf):
    if not next(flags):
      return leaf
    node = replacement
    for name in path_names(path):
      node = node[name]
    return node
  return jax.tree_util.tree_map_with_path(pick, tree)
