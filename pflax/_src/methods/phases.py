"""Local training in two phases: one part of the trained tree, then the other.

The engine runs a fixed number of local steps per round with one optimizer
(`pflax.train`). A method whose clients first train one part of their model
with the rest frozen, then the rest with the first part frozen (FedRep's head,
then body; FedALA's aggregation weights, then the model), does it with
`two_phases`: an optimizer whose state counts the round's steps. Steps
whose batch holds no real sample leave the optimizer state untouched
(`pflax.train.train_client`), so the count is the client's real steps.
`box_projection` keeps trained weights in a box (FedALA's `W`, APFL's `alpha`).
"""

from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax

from pflax._src.core import tree as tree_lib
from pflax._src.core import types


class TwoPhaseState(NamedTuple):
  """The optimizer state of each part and the round's step count.

  Attributes:
    first: the first part's optimizer state (the part `where` selects).
    second: the other part's optimizer state.
    step: int32, the steps taken this round.
  """
  first: Any
  second: Any
  step: chex.Array


def _pick(flag: chex.Array, new: Any, old: Any) -> Any:
  return jax.tree.map(lambda a, b: jnp.where(flag, a, b), new, old)


def _zeros(tree: Any) -> Any:
  return jax.tree.map(jnp.zeros_like, tree)


def two_phases(where: types.Selector, first: optax.GradientTransformation,
               second: optax.GradientTransformation,
               first_steps: int) -> optax.GradientTransformation:
  """Trains the leaves `where` selects for `first_steps` steps, then the others.

  Each part has its own optimizer state, touched only in its own phase: a
  frozen part gets zero updates and its state (momentum, Adam's moments and
  count) stays as it was, as for a PyTorch parameter with `requires_grad`
  off. Gradient clipping in `first` or `second` sees its own part's gradient
  only.

  Args:
    where: selector of the part trained first.
    first: the first part's optimizer.
    second: the other part's optimizer.
    first_steps: steps of the first phase (>= 0).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from pflax import tree
    >>> opt = two_phases(tree.under("head"), optax.sgd(1.0), optax.sgd(1.0), 1)
    >>> params = {"head": jnp.zeros(1), "body": jnp.zeros(1)}
    >>> grads = {"head": jnp.ones(1), "body": jnp.ones(1)}
    >>> updates, state = opt.update(grads, opt.init(params), params)
    >>> float(updates["head"][0]), float(updates["body"][0])
    (-1.0, 0.0)
    >>> updates, state = opt.update(grads, state, params)
    >>> float(updates["head"][0]), float(updates["body"][0])
    (0.0, -1.0)
  """
  if first_steps < 0:
    raise ValueError(f"first_steps must be >= 0, got {first_steps}.")

  def init(params):
    one, other = tree_lib.partition(params, where)
    return TwoPhaseState(first.init(one), second.init(other), jnp.zeros((), jnp.int32))

  def update(grads, state, params=None):
    g_one, g_other = tree_lib.partition(grads, where)
    p_one, p_other = tree_lib.partition(params, where)
    u_one, s_one = first.update(g_one, state.first, p_one)
    u_other, s_other = second.update(g_other, state.second, p_other)
    on_first = state.step < first_steps
    updates = tree_lib.combine(_pick(on_first, u_one, _zeros(u_one)),
                               _pick(on_first, _zeros(u_other), u_other))
    return updates, TwoPhaseState(_pick(on_first, s_one, state.first),
                                  _pick(on_first, state.second, s_other),
                                  state.step + 1)

  return optax.GradientTransformation(init, update)


def box_projection(low: float, high: float) -> optax.GradientTransformation:
  """Updates that keep the parameters in `[low, high]`: `clip(p + u) - p`, so that
  chained after SGD the step is projected gradient descent.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> opt = optax.chain(optax.sgd(1.0), box_projection(0.0, 1.0))
    >>> params = jnp.array([0.5, 0.5])
    >>> updates, _ = opt.update(jnp.array([-2.0, 0.25]), opt.init(params), params)
    >>> updates.tolist()
    [0.5, -0.25]
  """
  def update(updates, state, params=None):
    return jax.tree.map(lambda u, p: jnp.clip(p + u, low, high) - p,
                        updates, params), state
  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)
