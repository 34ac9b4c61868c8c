"""Which parts of a Flax model pflax's methods read: the one declaration per model.

FedAvg, FedProx, FedSA, FedDWA and local training treat a model as a whole.
The other methods read named parts of it: the output layer (cwFedAvg's WDR and
estimated class distribution p~, FedClassAvg's averaged classifier, the
output-layer norms of every run), FedReMa's classifier (the layers it
personalizes and probes) and FedClassAvg's representation (the features of its
contrastive loss). `Parts` declares them once; every algorithm and the engine
read them through it.

pflax's own models (`pflax.models.CNN`, `MLP`, the heterogeneous family) declare
their parts by their module names (`classifier/output`, `classifier`,
`representation`). Any other Flax model works once its parts are known:
`model_parts(model, input_shape, num_classes)` finds the output layer as the
last `nn.Dense` the model calls (its kernel `(D, K)`), or the user names it,
e.g. `Parts(output=pflax.tree.under("Dense_2"))`.
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from pflax._src.core import tree as tree_lib
from pflax._src.core import types
from pflax._src.training import adapters
from pflax._src.training import models as models_lib

PFLAX_OUTPUT = tree_lib.under("classifier", "output")
"""The output layer (kernel and bias) of pflax's models."""
PFLAX_CLASSIFIER = tree_lib.under("classifier")
"""Every Dense layer after the feature extractor of pflax's models."""

Representation = Callable[[types.Tree, chex.Array], chex.Array]
"""`representation(params, x) -> (B, D)`: one client's features of a batch."""
ApplyClassifier = Callable[[types.Tree, chex.Array], chex.Array]
"""`apply_classifier(classifier_params, h) -> (B, K)` logits, where
`classifier_params = pflax.tree.selected(params, parts.classifier)`."""


class Parts(NamedTuple):
  """The parts of a model that pflax's methods read.

  Attributes:
    output: selector of the output layer, one `Dense`-like layer whose
      `kernel` is `(D, K)` (with an optional `bias` `(K,)`): cwFedAvg's WDR
      (Eq. 8) and p~ (Eq. 11), FedClassAvg's averaged classifier, the
      output-layer norms of every run.
    classifier: selector of the layers FedReMa personalizes and probes (None:
      the output layer).
    apply_classifier: FedReMa's classifier as a function (`ApplyClassifier`);
      None: the output layer alone, `h @ kernel + bias`, which needs
      `classifier` to select only the output layer.
    representation: FedClassAvg's contrastive features (`Representation`);
      None: the input of the output layer.
    feature_dim: the classifier's input width F (FedReMa's probe); None: the
      rows of the classifier's first kernel in key order.

  Example:
    >>> import flax.linen as nn
    >>> from pflax import tree
    >>> mlp = nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(10)])
    >>> parts = Parts(output=tree.under("layers_2"))
    >>> parts.classifier is None
    True
  """
  output: types.Selector
  classifier: types.Selector | None = None
  apply_classifier: ApplyClassifier | None = None
  representation: Representation | None = None
  feature_dim: int | None = None


def is_pflax_model(model: nn.Module) -> bool:
  """Whether `model` is one of pflax's split models (`features`, `classifier`)."""
  return isinstance(model, models_lib.SplitModel)


@functools.lru_cache(maxsize=64)
def pflax_parts(model: nn.Module) -> Parts:
  """The parts of a pflax model, by its module names (see `pflax.models`); one
  `Parts` per model, so that plans holding it compare equal."""
  head = model.head()
  return Parts(
      output=PFLAX_OUTPUT, classifier=PFLAX_CLASSIFIER,
      apply_classifier=lambda params, h: head.apply(
          {"params": params["classifier"]}, h),
      representation=lambda params, x: model.apply(
          {"params": params}, x, method="representation"))


def _dense_calls(model: nn.Module, input_shape: Sequence[int]
                 ) -> tuple[list[tuple[str, ...]], Any]:
  """The paths of the `nn.Dense` layers `model` calls, in call order, and the
  shapes of its parameters (abstract: nothing is computed)."""
  paths = []

  def record(next_fun, args, kwargs, context):
    if context.method_name == "__call__" and isinstance(context.module, nn.Dense):
      paths.append(tuple(context.module.path))
    return next_fun(*args, **kwargs)

  x = jax.ShapeDtypeStruct((1, *input_shape), jnp.float32)
  with nn.intercept_methods(record):
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
  return paths, variables.get("params", {})


def model_parts(model: nn.Module, input_shape: Sequence[int],
                num_classes: int | None = None) -> Parts:
  """A model's `Parts`: pflax's by name, else the last `nn.Dense` it calls.

  Args:
    model: any Flax model mapping `(B, *input_shape)` to logits `(B, K)`.
    input_shape: one example's shape, without the batch axis.
    num_classes: K, checked against the found layer's width when given.

  Returns:
    The parts; for a model that is not pflax's, `output` selects the last
    `nn.Dense` layer called, and the other fields keep their defaults.

  Raises:
    ValueError: the model calls no `nn.Dense`, or the last one is not `K` wide.

  Example:
    >>> import flax.linen as nn
    >>> mlp = nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(10)])
    >>> model_parts(mlp, (64,), 10).output
    pflax.tree.under('layers_2',)
  """
  model = adapters.as_model(model)
  if is_pflax_model(model):
    return pflax_parts(model)
  name = type(model).__name__
  if isinstance(model, adapters.Adapted):
    return _adapted_parts(model, input_shape, num_classes)
  paths, params = _dense_calls(model, input_shape)
  if not paths:
    raise ValueError(
        f"model {name} calls no flax.linen.Dense layer, so pflax cannot find its "
        "output layer: declare it, e.g. parts=pflax.models.Parts(output="
        "pflax.tree.under('<output layer name>')).")
  path = paths[-1]
  output = tree_lib.under(*path)
  width = output_kernel(params, output).shape[-1]
  if num_classes is not None and width != num_classes:
    raise ValueError(
        f"model {name}: its last Dense layer {'/'.join(path)} has {width} outputs, "
        f"expected num_classes = {num_classes}; declare the output layer with "
        "parts=pflax.models.Parts(output=pflax.tree.under(...)).")
  return Parts(output=output)


LINEAR_LAYERS = {"nnx": "flax.nnx.Linear", "equinox": "equinox.nn.Linear"}
"""The layer type whose last call is an adapted model's output layer."""


def _adapted_parts(model: adapters.Adapted, input_shape: Sequence[int],
                   num_classes: int | None) -> Parts:
  """An NNX or Equinox model's parts: the last linear layer it calls."""
  found = model.linear_calls(input_shape)
  declare = ("declare it, e.g. parts=pflax.models.Parts(output="
             "pflax.tree.under('<output layer name>')).")
  if found is None:
    raise ValueError(f"model {model.name} is a pair of functions, whose layers pflax "
                     f"cannot see, so pflax cannot find its output layer: {declare}")
  paths, params = found
  if not paths:
    raise ValueError(f"model {model.name} calls no {LINEAR_LAYERS[model.kind]} layer, "
                     f"so pflax cannot find its output layer: {declare}")
  output = tree_lib.under(*paths[-1])
  width = output_kernel(params, output).shape[-1]
  if num_classes is not None and width != num_classes:
    raise ValueError(
        f"model {model.name}: its last {LINEAR_LAYERS[model.kind]} layer "
        f"{'/'.join(paths[-1])} has {width} outputs, expected num_classes = "
        f"{num_classes}; {declare}")
  return Parts(output=output)


def output_kernel(params: types.Tree, where: types.Selector = PFLAX_OUTPUT
                  ) -> chex.Array:
  """The output layer's kernel `(..., D, K)`: the one `kernel` leaf `where` selects.

  Works on one model's parameters and on stacked ones (`(M, D, K)`).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from pflax import models
    >>> params = models.MLP(10).init(jax.random.key(0), jnp.zeros((1, 64)))['params']
    >>> output_kernel(params).shape
    (200, 10)
  """
  kernels = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(
      tree_lib.selected(params, where) or {})
             if tree_lib.path_names(path)[-1] == "kernel"]
  if len(kernels) != 1:
    raise ValueError(
        f"parts.output must select one layer with a 'kernel' (D, K), selects "
        f"{len(kernels)} kernels ({tree_lib.top_level_keys(params)}).")
  return kernels[0]


def _affine(params: types.Tree, h: chex.Array) -> chex.Array:
  """`h @ kernel + bias` of the single Dense layer in `params`."""
  leaves = [(tree_lib.path_names(p)[-1], leaf)
            for p, leaf in jax.tree_util.tree_leaves_with_path(params)]
  kernels = [leaf for name, leaf in leaves if name == "kernel"]
  if len(kernels) != 1:
    raise ValueError(
        f"parts.classifier selects {len(kernels)} layers with a kernel: a classifier "
        "of several layers needs parts.apply_classifier (its function).")
  biases = [leaf for name, leaf in leaves if name == "bias"]
  return h @ kernels[0] + (biases[0] if biases else 0.0)


def classifier_selector(parts: Parts) -> types.Selector:
  """The layers FedReMa personalizes: `parts.classifier`, else the output layer."""
  return parts.output if parts.classifier is None else parts.classifier


def classifier_fn(parts: Parts) -> ApplyClassifier:
  """FedReMa's classifier: `parts.apply_classifier`, else the affine output layer."""
  return parts.apply_classifier or _affine


def classifier_width(parts: Parts, classifier_params: types.Tree) -> int:
  """F: `parts.feature_dim`, else the rows of the first kernel (key order)."""
  if parts.feature_dim is not None:
    return parts.feature_dim
  kernels = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(
      classifier_params) if tree_lib.path_names(path)[-1] == "kernel"]
  return kernels[0].shape[-2]


def _linen_inputs(model: nn.Module, params: types.Tree, x: chex.Array,
                  where: types.Selector) -> list[chex.Array]:
  """The inputs of the layers `where` selects, captured while the model runs."""
  seen = []

  def capture(next_fun, args, kwargs, context):
    path = tuple(context.module.path)
    if (context.method_name == "__call__" and path
        and where(path + ("kernel",), None)):
      seen.append(args[0])
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(capture):
    model.apply({"params": params}, x)
  return seen


def _output_input(model: Any, where: types.Selector) -> Representation:
  """The input of the output layer (linen or adapted), captured while the model runs."""
  inputs = (model.output_input if isinstance(model, adapters.Adapted)
            else functools.partial(_linen_inputs, model))

  def representation(params, x):
    seen = inputs(params, x, where)
    if not seen:
      raise ValueError(
          f"model {adapters.model_name(model)}: parts.output selects no layer that "
          "the model calls; declare parts.representation for FedClassAvg.")
    return seen[-1].reshape(seen[-1].shape[0], -1)
  return representation


def representation_fn(model: nn.Module, parts: Parts) -> Representation:
  """FedClassAvg's features: `parts.representation`, else the output layer's input."""
  if parts.representation is not None:
    return parts.representation
  if not callable(parts.output):
    raise ValueError("parts.representation is needed when parts.output is a mask "
                     "pytree, not a selector function.")
  return _output_input(adapters.as_model(model), parts.output)


def resolve(model: nn.Module, parts: Parts | None, builder: str) -> Parts:
  """`parts`, or a pflax model's own; a builder's error names what to declare."""
  if parts is not None:
    return parts
  if is_pflax_model(model):
    return pflax_parts(model)
  raise ValueError(
      f"{builder} reads the output layer of model {adapters.model_name(model)}, which "
      "is not one of pflax's models: pass parts=pflax.models.model_parts(model, "
      "input_shape, num_classes) or parts=pflax.models.Parts(output="
      "pflax.tree.under('<output layer name>')).")


def checked(model: nn.Module, parts: Parts | None, input_shape: Sequence[int],
            num_classes: int) -> Parts:
  """The model's parts (`parts`, else `model_parts`), once the model is checked.

  Raises:
    ValueError: unless `model` maps `(B, *input_shape)` to `(B, K)` logits and
      the output layer is one `(D, K)` kernel of its parameters (checked
      abstractly: nothing is computed).
  """
  model = adapters.as_model(model)
  name = adapters.model_name(model)
  x = jax.ShapeDtypeStruct((2, *input_shape), jnp.float32)
  try:
    params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
    logits = jax.eval_shape(lambda p, v: model.apply({"params": p}, v), params, x)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f"model {name} does not accept inputs of input_shape "
                     f"{tuple(input_shape)}: {type(e).__name__}: "
                     f"{str(e).splitlines()[0] if str(e) else ''}") from None
  if logits.shape != (2, num_classes):
    raise ValueError(f"model {name} gives outputs of shape {logits.shape[1:]} per "
                     f"example, expected num_classes = ({num_classes},) logits.")
  parts = parts or model_parts(model, input_shape, num_classes)
  kernel = output_kernel(params, parts.output)
  if kernel.ndim != 2 or kernel.shape[-1] != num_classes:
    raise ValueError(f"parts.output of model {name} selects a kernel of shape "
                     f"{kernel.shape}, expected (D, {num_classes}).")
  return parts
