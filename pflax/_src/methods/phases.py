"""Local training in two phases: one part of the trained tree, then the other.

The engine runs a fixed number of local steps per round with one optimizer
(`pflax.train`). A method whose clients first train one part of their model
with the rest frozen, then the rest with the first part frozen (FedRep's head,
then body; FedALA's aggregation weights, then the model), does it with
`two_phases`: `optax.partition` of the two parts, each part's optimizer
active in its own phase only (`masked_outside`), its state counting the
round's steps. Steps whose batch holds no real sample leave the optimizer state
untouched (`pflax.train.train_client`), so the count is the client's real
steps. `box_projection` keeps trained weights in a box (FedALA's `W`, APFL's
`alpha`).
"""

from collections.abc import Callable

import chex
import jax
import jax.numpy as jnp
import optax

from pflax._src.core import tree as tree_lib
from pflax._src.core import types


def masked_outside(inner: optax.GradientTransformation,
                   active: Callable[[chex.Array], chex.Array]
                   ) -> optax.GradientTransformation:
  """`inner` at the steps `t` (counted from 0) where `active(t)`; elsewhere zero
  updates and `inner`'s state unchanged.

  `optax.transforms.conditionally_mask`, state included
  (`ConditionallyMaskState`), choosing with `jnp.where` instead of its
  `lax.cond`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> opt = masked_outside(optax.sgd(1.0), lambda step: step >= 1)
    >>> params = jnp.zeros(1)
    >>> updates, state = opt.update(jnp.ones(1), opt.init(params), params)
    >>> updates, state = opt.update(jnp.ones(1), state, params)
    >>> float(updates[0]), int(state.step)
    (-1.0, 2)

  Notes:
    [settled] Under `jit` the `lax.cond` changes how XLA fuses the inner
    update: FedRep's and FedALA's losses and models then differ in the last
    bits from this `jnp.where`'s, which are the former hand-written two-phase
    optimizer's. (With a step count batched over clients, `lax.cond` is a
    select anyway.)
  """
  def init(params):
    return optax.transforms.ConditionallyMaskState(
        step=jnp.zeros([], jnp.int32), inner_state=inner.init(params))

  def update(updates, state, params=None):
    on = active(state.step)
    new_updates, new_state = inner.update(updates, state.inner_state, params)
    pick = lambda new, old: jax.tree.map(lambda a, b: jnp.where(on, a, b), new, old)
    return pick(new_updates, jax.tree.map(jnp.zeros_like, new_updates)), (
        optax.transforms.ConditionallyMaskState(
            step=state.step + 1, inner_state=pick(new_state, state.inner_state)))

  return optax.GradientTransformation(init, update)


def two_phases(where: types.Selector, first: optax.GradientTransformation,
               second: optax.GradientTransformation,
               first_steps: int) -> optax.GradientTransformation:
  """Trains the leaves `where` selects for `first_steps` steps, then the others.

  `optax.partition` of the parts labelled "first" and "second", each part's
  optimizer `masked_outside` its phase: a frozen part gets zero updates and
  its state (momentum, Adam's moments and count) stays as it was, as for a
  PyTorch parameter with `requires_grad` off. Gradient clipping in `first` or
  `second` sees its own part's gradient only. The state is optax's
  `PartitionState`, its inner states `{"first": ..., "second": ...}` each
  counting the round's steps (`ConditionallyMaskState.step`).

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

  def labels(tree):
    return tree_lib.map_selected(lambda _: "first", lambda _: "second", tree,
                                 tree_lib.selection(tree, where))

  return optax.partition(
      {"first": masked_outside(first, lambda step: step < first_steps),
       "second": masked_outside(second, lambda step: step >= first_steps)},
      labels)


def box_projection(low: float, high: float) -> optax.GradientTransformation:
  """Updates that keep the parameters in `[low, high]`: `clip(p + u) - p`
  (`optax.projections.projection_box` of each updated leaf), so that
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
    # Leaf by leaf: `projection_box` takes scalar bounds for one array only.
    return jax.tree.map(
        lambda u, p: optax.projections.projection_box(p + u, low, high) - p,
        updates, params), state
  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)
