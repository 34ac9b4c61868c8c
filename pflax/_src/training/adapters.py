"""Any JAX model as the slice of a Flax linen module that pflax calls.

pflax trains and evaluates a model through two calls, as on a linen module:
`model.init(key, x) -> {"params": params}` and
`model.apply({"params": params}, x) -> (B, K) logits`, with `params` a pytree
of arrays. `as_model` gives that interface to

- a Flax linen module: returned as it is (pflax's own path, unchanged);
- a Flax NNX module, an instance or a constructor taking `rngs`: the
  parameters are its `nnx.Param` state as a plain nested dict keyed by
  attribute path (`nnx.to_pure_dict`; a list's entries by index);
- an Equinox module, an instance or a constructor taking `key`: the
  parameters are its inexact arrays as a nested dict keyed by attribute path,
  an `eqx.nn.Linear`'s `weight (K, D)` held as Flax's `kernel (D, K)` (its
  transpose) so that the output layer reads as for Flax models; Equinox
  layers act on one example, so `apply` vmaps the model over the batch;
- a pair `(init_fn, apply_fn)`: `init_fn(key, x) -> params` and
  `apply_fn(params, x) -> logits` (Haiku-style or hand-written models).

[settled] Only parameters are carried. A model with other state (NNX
`BatchStat` or `RngState`, Equinox's `eqx.nn.State`) is refused: every
algorithm's state, aggregation and checkpoint is a pytree of parameters per
client, and statistics that are not trained by gradients would need their own
per-client carry and their own aggregation rule (FedBN keeps them local,
FedAvg would average them), which no method of pflax defines.

An instance gives every run the same initial parameters (its own): the seed
still changes the partition, the shuffles and every other random choice. A
constructor is called with the run's initialisation key, so seeds differ.

Each adapter also finds its model's linear layers in call order and the input
of one of them, which `pflax.models.model_parts` and FedClassAvg's default
representation read (`linear_calls`, `output_input`); a pair of functions
has no layers to find and declares its `pflax.models.Parts`.
"""

import dataclasses
import inspect
import types as types_lib
from collections.abc import Callable, Sequence
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from pflax._src.core import types

ACCEPTED = ("a flax.linen.Module; a flax.nnx.Module instance or a constructor "
            "taking rngs; an equinox.Module instance or a constructor taking key; "
            "or a pair (init_fn, apply_fn) with init_fn(key, x) -> params and "
            "apply_fn(params, x) -> logits")
"""What `as_model` accepts, as its error message says it."""

Path = tuple[str, ...]


class Adapted:
  """Base of the adapters: `init`/`apply` as on a linen module. An adapter
  equals only itself: an instance's parameters are read when it is adapted,
  so a later adapter of the same (possibly changed) object must not share the
  programs compiled for an earlier one."""
  kind = ""
  source: Any

  @property
  def name(self) -> str:
    """The adapted model's name, for messages."""
    if isinstance(self.source, tuple):
      return getattr(self.source[1], "__name__", "apply_fn")
    return model_name(self.source)

  def init(self, key: chex.PRNGKey, x: chex.Array) -> dict[str, types.Tree]:
    raise NotImplementedError

  def apply(self, variables: dict[str, types.Tree], x: chex.Array) -> chex.Array:
    raise NotImplementedError

  def linear_calls(self, input_shape: Sequence[int]
                   ) -> tuple[list[Path], types.Tree] | None:
    """The paths of the linear layers the model calls, in call order, and its
    parameters' shapes (abstract); None where layers cannot be found."""
    del input_shape
    return None

  def output_input(self, params: types.Tree, x: chex.Array,
                   where: types.Selector) -> list[chex.Array]:
    """The inputs `(B, ...)` of the linear layers `where` selects, in call order."""
    raise NotImplementedError


def _takes(constructor: Callable[..., Any], keyword: str) -> bool:
  """Whether `constructor` has a parameter named `keyword`."""
  try:
    return keyword in inspect.signature(constructor).parameters
  except (TypeError, ValueError):
    return False


def _names(path: Sequence[Any]) -> Path:
  return tuple(str(p) for p in path)


def _with_str_keys(tree: Any) -> Any:
  """A nested dict with every key a string (a list's index `0` as `"0"`), as
  `pflax.tree`'s selectors name them."""
  if isinstance(tree, dict):
    return {str(k): _with_str_keys(v) for k, v in tree.items()}
  return tree


def _key_template(tree: Any) -> Any:
  """The keys of a nested dict, its leaves dropped."""
  return {k: _key_template(v) for k, v in tree.items()} if isinstance(tree, dict) else None


def _with_keys(tree: Any, template: Any) -> Any:
  """`tree` (string keys) with the original keys of `template` (`_key_template`)."""
  if template is None:
    return tree
  return {k: _with_keys(tree[str(k)], sub) for k, sub in template.items()}


# ----------------------------------------------------------------------- NNX --


def _refuse_state(name: str, rest: Any) -> None:
  """Raises ValueError when an NNX model holds state other than `nnx.Param`."""
  kinds = sorted({type(v).__name__ for v in jax.tree.leaves(
      rest, is_leaf=lambda v: isinstance(v, nnx.Variable))})
  if kinds:
    raise ValueError(
        f"model {name} holds state other than nnx.Param ({', '.join(kinds)}); pflax "
        "carries only a model's parameters per client: use layers without running "
        "statistics (e.g. nnx.LayerNorm, nnx.GroupNorm for nnx.BatchNorm) and do not "
        "keep nnx.Rngs in the model (nnx.Dropout(rate) without rngs).")


@dataclasses.dataclass(eq=False)
class NNXModel(Adapted):
  """A Flax NNX module (`instance`) or a constructor `constructor(rngs=...)`."""
  source: Any
  kind = "nnx"

  def __post_init__(self):
    constructor = not isinstance(self.source, nnx.Module)
    module = (nnx.eval_shape(lambda: self.source(rngs=nnx.Rngs(0))) if constructor
              else self.source)
    self.graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    _refuse_state(self.name, rest)
    self.keys = _key_template(nnx.to_pure_dict(params))
    self.params = None if constructor else _with_str_keys(nnx.to_pure_dict(params))

  def init(self, key, x):
    del x
    if self.params is not None:
      return {"params": jax.tree.map(jnp.asarray, self.params)}
    _, params, _ = nnx.split(self.source(rngs=nnx.Rngs(key)), nnx.Param, ...)
    return {"params": _with_str_keys(nnx.to_pure_dict(params))}

  def _module(self, params: types.Tree) -> Any:
    return nnx.merge(self.graphdef, _with_keys(params, self.keys))

  def apply(self, variables, x):
    return self._module(variables["params"])(x)

  def _recording(self, params: types.Tree, log: list[tuple[Path, chex.Array]]) -> Any:
    """The model whose every `nnx.Linear` appends `(path, input)` to `log`."""
    module = self._module(params)
    for path, node in nnx.iter_graph(module):
      if isinstance(node, nnx.Linear):
        node.dot_general = _recorded(node.dot_general or jax.lax.dot_general,
                                     _names(path), log)
    return module

  def linear_calls(self, input_shape):
    log = []
    x = jax.ShapeDtypeStruct((1, *input_shape), jnp.float32)
    params = jax.eval_shape(self.init, jax.random.key(0), x)["params"]
    jax.eval_shape(lambda p, v: self._recording(p, log)(v), params, x)
    return [path for path, _ in log], params

  def output_input(self, params, x, where):
    log = []
    self._recording(params, log)(x)
    return [h for path, h in log if where(path + ("kernel",), None)]


def _recorded(dot_general: Callable[..., Any], path: Path,
              log: list[tuple[Path, chex.Array]]) -> Callable[..., Any]:
  """`dot_general` that first logs its left operand (the layer's input)."""
  def call(lhs, rhs, *args, **kwargs):
    log.append((path, lhs))
    return dot_general(lhs, rhs, *args, **kwargs)
  return call


# ------------------------------------------------------------------ Equinox --


def _equinox():
  try:
    import equinox  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ValueError("an Equinox model needs equinox: pip install 'pflax[equinox]'."
                     ) from None
  return equinox


def _is_equinox(obj: Any) -> bool:
  """Whether `obj` is an Equinox module or its class (without importing Equinox
  for other objects)."""
  cls = obj if isinstance(obj, type) else type(obj)
  return any(c.__module__.startswith("equinox") and c.__name__ == "Module"
             for c in cls.__mro__)


def _key_name(entry: Any) -> Any:
  if isinstance(entry, jax.tree_util.GetAttrKey):
    return entry.name
  if isinstance(entry, jax.tree_util.SequenceKey):
    return entry.idx
  return entry.key


def _node(tree: Any, path: Sequence[Any]) -> Any:
  for entry in path:
    tree = (getattr(tree, entry.name) if isinstance(entry, jax.tree_util.GetAttrKey)
            else tree[_key_name(entry)])
  return tree


class _Recorded:
  """A layer that logs `(path, input)` before it runs (inside a traced call)."""

  def __init__(self, layer: Any, path: Path, log: list[tuple[Path, chex.Array]]):
    self.layer, self.path, self.log = layer, path, log

  def __call__(self, x, *args, **kwargs):
    self.log.append((self.path, x))
    return self.layer(x, *args, **kwargs)


@dataclasses.dataclass(eq=False)
class EquinoxModel(Adapted):
  """An Equinox module (instance) or a constructor `constructor(key=...)`."""
  source: Any
  kind = "equinox"

  def __post_init__(self):
    eqx = self.eqx = _equinox()
    constructor = not isinstance(self.source, eqx.Module)
    module = (eqx.filter_eval_shape(self.source, key=jax.random.key(0))
              if constructor else self.source)
    if any(isinstance(v, eqx.nn.StateIndex) for v in jax.tree.leaves(
        module, is_leaf=lambda v: isinstance(v, eqx.nn.StateIndex))):
      raise ValueError(
          f"model {self.name} holds eqx.nn.State (e.g. eqx.nn.BatchNorm); pflax carries "
          "only a model's parameters per client: use layers without running statistics "
          "(eqx.nn.LayerNorm, eqx.nn.GroupNorm).")
    params, self.static = eqx.partition(module, self._is_param)
    if any(isinstance(v, jax.ShapeDtypeStruct) for v in jax.tree.leaves(self.static)):
      raise ValueError(f"model {self.name}: the constructor builds arrays that are not "
                       "floating point; pass an instance of the model instead.")
    leaves, self.treedef = jax.tree_util.tree_flatten_with_path(params)
    self.linears = [tuple(path) for path, v in jax.tree_util.tree_flatten_with_path(
        module, is_leaf=lambda v: isinstance(v, eqx.nn.Linear))[0]
                    if isinstance(v, eqx.nn.Linear)]
    self.views = [self._view(tuple(path), set(self.linears)) for path, _ in leaves]
    self.params = None if constructor else self._to_dict(params)

  def _is_param(self, v: Any) -> bool:
    return self.eqx.is_inexact_array(v) or (
        isinstance(v, jax.ShapeDtypeStruct) and jnp.issubdtype(v.dtype, jnp.inexact))

  @staticmethod
  def _view(path: tuple[Any, ...], linears: set[Any]) -> tuple[tuple[Any, ...], bool]:
    """A leaf's key path in the dict view, and whether it is a transposed weight."""
    names = _names(_key_name(p) for p in path)
    if path[:-1] in linears and names[-1] == "weight":
      return names[:-1] + ("kernel",), True
    return names, False

  def _to_dict(self, params: Any) -> dict[str, Any]:
    out: dict[Any, Any] = {}
    for (names, transposed), leaf in zip(self.views, jax.tree.leaves(params)):
      node = out
      for name in names[:-1]:
        node = node.setdefault(name, {})
      node[names[-1]] = leaf.T if transposed else leaf
    return out

  def _from_dict(self, params: dict[str, Any]) -> Any:
    leaves = []
    for names, transposed in self.views:
      leaf = params
      for name in names:
        leaf = leaf[name]
      leaves.append(leaf.T if transposed else leaf)
    return self.treedef.unflatten(leaves)

  def _model(self, params: dict[str, Any]) -> Any:
    return self.eqx.combine(self._from_dict(params), self.static)

  def init(self, key, x):
    del x
    if self.params is not None:
      return {"params": jax.tree.map(jnp.asarray, self.params)}
    return {"params": self._to_dict(self.eqx.filter(self.source(key=key),
                                                    self.eqx.is_inexact_array))}

  def apply(self, variables, x):
    return jax.vmap(self._model(variables["params"]))(x)

  def _recording(self, params: dict[str, Any], log: list[tuple[Path, chex.Array]],
                 chosen: Callable[[Path], bool] = lambda path: True) -> Any:
    model = self._model(params)
    paths = [p for p in self.linears if chosen(_names(_key_name(e) for e in p))]
    if not paths:
      return model
    return self.eqx.tree_at(
        lambda m: [_node(m, p) for p in paths], model,
        [_Recorded(_node(model, p), _names(_key_name(e) for e in p), log)
         for p in paths])

  def linear_calls(self, input_shape):
    log = []
    x = jax.ShapeDtypeStruct((1, *input_shape), jnp.float32)
    params = jax.eval_shape(self.init, jax.random.key(0), x)["params"]
    jax.eval_shape(lambda p, v: jax.vmap(self._recording(p, log))(v), params, x)
    return [path for path, _ in log], params

  def output_input(self, params, x, where):
    chosen = lambda path: bool(where(path + ("kernel",), None))

    def one(example):
      log = []
      self._recording(params, log, chosen)(example)
      return [h for _, h in log]
    return jax.vmap(one)(x)


# ------------------------------------------------------------ two functions --


@dataclasses.dataclass(eq=False)
class FunctionsModel(Adapted):
  """A pair `(init_fn, apply_fn)`: `init_fn(key, x) -> params`,
  `apply_fn(params, x) -> logits`."""
  source: tuple[Callable[..., Any], Callable[..., Any]]
  kind = "functions"

  def init(self, key, x):
    return {"params": self.source[0](key, x)}

  def apply(self, variables, x):
    return self.source[1](variables["params"], x)

  def output_input(self, params, x, where):
    raise ValueError(f"model {self.name} is a pair of functions, whose layers pflax "
                     "cannot see: declare parts.representation.")


def as_model(model: Any) -> Any:
  """`model` with `init(key, x) -> {"params": ...}` and
  `apply({"params": ...}, x) -> logits`, as pflax calls a Flax linen module.

  Args:
    model: a Flax linen module (returned as it is), a Flax NNX module or a
      constructor taking `rngs`, an Equinox module or a constructor taking
      `key`, or a pair `(init_fn, apply_fn)` (see the module docstring).

  Returns:
    The linen module, or its adapter (`Adapted`).

  Raises:
    ValueError: for an object of none of these kinds (naming what pflax
      accepts), and for a model holding state other than parameters.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> model = as_model(lambda rngs: nnx.Linear(4, 3, rngs=rngs))
    >>> params = model.init(jax.random.key(0), jnp.ones((2, 4)))["params"]
    >>> sorted(params), model.apply({"params": params}, jnp.ones((2, 4))).shape
    (['bias', 'kernel'], (2, 3))
  """
  if isinstance(model, (nn.Module, Adapted)):
    return model
  if isinstance(model, nnx.Module) or (isinstance(model, type)
                                       and issubclass(model, nnx.Module)):
    return NNXModel(model)
  if _is_equinox(model):
    return EquinoxModel(model)
  if (isinstance(model, tuple) and len(model) == 2
      and all(callable(f) for f in model)):
    return FunctionsModel(model)
  if isinstance(model, type) and issubclass(model, nn.Module):
    raise ValueError(f"model {model.__name__} is a flax.linen.Module class: pass an "
                     f"instance, e.g. {model.__name__}(...).")
  if callable(model) and _takes(model, "rngs"):
    return NNXModel(model)
  if callable(model) and _takes(model, "key"):
    return EquinoxModel(model)
  raise ValueError(f"model must be {ACCEPTED}; got {type(model).__name__}.")



def model_name(model: Any) -> str:
  """The name of a model (adapted, linen, a class, a constructor function, or
  a list of them), for messages."""
  if isinstance(model, Adapted):
    return model.name
  if isinstance(model, list):
    return f"[{', '.join(map(model_name, model))}]"
  if isinstance(model, (type, types_lib.FunctionType)):
    return model.__name__
  return type(model).__name__
