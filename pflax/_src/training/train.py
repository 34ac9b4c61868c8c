"""Local training of one client, with the semantics of a per-client loop.

Client i, in every local epoch, visits its own `n_i` samples in a fresh random
order in `ceil(n_i / B)` mini-batches (the last one smaller), one optimizer step
per batch, the loss averaged over the real samples of the batch. Clients are
padded to a common length L so that one compiled program serves them all: the
padded samples are ordered last, so they never enter a real batch, and steps
whose batch holds no real sample leave parameters and optimizer state untouched.
`make_trainer` maps the per-client step over the stacked clients of a round
with one of `pflax.train.STRATEGIES` (see `map_clients`), or, with strategy
"steps", scans the local steps of all clients at once (`TRAINER_STRATEGIES`).
"""

import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax

from pflax._src.core import types
from pflax._src.training import mapping


class Batch(NamedTuple):
  """One client's mini-batch: inputs, labels and a validity mask `(B,)`."""
  x: chex.Array
  y: chex.Array
  mask: chex.Array


LossFn = Callable[[types.Tree, Any, Batch, chex.PRNGKey], chex.Array]
"""`loss_fn(params, context, batch, key) -> scalar` for one client."""


def _num_steps(length: int, batch_size: int) -> int:
  """Steps per epoch for the longest client: `ceil(L / B)`."""
  return -(-length // batch_size)


def _epoch_order(key: chex.PRNGKey, valid: chex.Array) -> chex.Array:
  """A uniformly random order of the valid samples, followed by the padding.

  Sample j's sort key is the first word of `fold_in(key, j)` (one threefry
  hash per sample), so the order of a client's samples does not depend on how
  far its data are padded.
  """
  word = lambda j: jax.random.key_data(jax.random.fold_in(key, j))[0]
  bits = jax.vmap(word)(jnp.arange(valid.shape[0]))
  u = (bits >> 8).astype(jnp.float32) * 2.0**-24  # uniform on [0, 1), exact
  return jnp.argsort(jnp.where(valid, u, 2.0))


def batch_schedule(key: chex.PRNGKey, valid: chex.Array, epochs: int,
                   batch_size: int) -> tuple[chex.Array, chex.Array]:
  """Sample indices `(E * S, B)` and their validity for all local steps.

  Epoch e shuffles with `fold_in(key, e)`; padding ordered last only makes
  trailing steps of an epoch empty, so the real steps do not depend on the
  padded length.
  """
  length = valid.shape[0]
  steps = _num_steps(length, batch_size)
  epoch_keys = jax.vmap(functools.partial(jax.random.fold_in, key))(jnp.arange(epochs))
  orders = jax.vmap(_epoch_order, in_axes=(0, None))(epoch_keys, valid)
  pad = steps * batch_size - length
  orders = jnp.pad(orders, ((0, 0), (0, pad)))
  in_range = jnp.arange(steps * batch_size) < length
  index = orders.reshape(epochs * steps, batch_size)
  real = (valid[orders] & in_range).reshape(epochs * steps, batch_size)
  return index, real


def _step_keys(key: chex.PRNGKey, epochs: int, steps: int) -> chex.Array:
  """Keys `(E * S,)` of the local steps: `fold_in(fold_in(key, e), s)`."""
  per_epoch = lambda e: jax.vmap(functools.partial(
      jax.random.fold_in, jax.random.fold_in(key, e)))(jnp.arange(steps))
  keys = jax.vmap(per_epoch)(jnp.arange(epochs))
  return keys.reshape(epochs * steps, *keys.shape[2:])


MAX_FULL_UNROLL = 64
"""Default `unroll`: convolutional schedules of at most this many steps are unrolled."""


def _primitives(jaxpr: Any) -> Iterator[str]:
  """Names of the primitives of a jaxpr, nested jaxprs (scan, jit, ...) included."""
  for eqn in jaxpr.eqns:
    yield eqn.primitive.name
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _primitives(inner)


def _has_convolution(fn: Callable[..., Any], *args: Any) -> bool:
  """Whether `fn(*args)` computes a convolution.

  `fn` is traced on the shapes and dtypes of `args` (arrays, tracers or
  `jax.ShapeDtypeStruct`s; nothing runs) and its jaxpr, nested jaxprs
  included, is searched for `conv_general_dilated`. `make_trainer` uses it to
  decide whether unrolling the local steps pays on XLA-CPU.

  Example:
    >>> import jax.numpy as jnp
    >>> _has_convolution(lambda x: x @ x.T, jnp.ones((2, 3)))
    False
  """
  shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)),
                        args)
  return "conv_general_dilated" in _primitives(jax.make_jaxpr(fn)(*shapes).jaxpr)


def _scan_unroll(unroll: int | bool | None, steps: int,
                 convolutional: Callable[[], bool]) -> int | bool:
  """The `lax.scan` unroll for `steps` local steps.

  None: all steps (up to `MAX_FULL_UNROLL`) when the step holds a convolution
  and runs on XLA-CPU, else a rolled loop.
  """
  if unroll is None:
    return (steps <= MAX_FULL_UNROLL and jax.default_backend() == "cpu"
            and convolutional())
  return unroll if isinstance(unroll, bool) else max(1, min(unroll, steps))


def _client_schedule(valid: chex.Array, key: chex.PRNGKey, *, epochs: int,
                     batch_size: int) -> tuple[chex.Array, chex.Array, chex.Array]:
  """One client's sample indices and validity `(E * S, B)` (`batch_schedule`) and
  step keys `(E * S,)` (`_step_keys`), both drawn from `key`."""
  order_key, step_key = jax.random.split(key)
  index, real = batch_schedule(order_key, valid, epochs, batch_size)
  return index, real, _step_keys(step_key, epochs, _num_steps(valid.shape[0], batch_size))


def _fully_unrolled(scan_unroll: int | bool, steps: int) -> bool:
  """Whether a `lax.scan` of `steps` steps with this `unroll` leaves no loop."""
  return scan_unroll is True or (scan_unroll is not False and scan_unroll >= steps)


def _carried_flags(active: chex.Array) -> tuple[chex.Array, chex.Array]:
  """The first step's flags and, for every step, the next step's (the last wraps).

  The local-step loops carry whether the current step holds a real sample
  (`active`, `(E * S, ...)`) from one step to the next, instead of computing it
  from the step's own batch: the same values, but a flag that enters the step
  as a loop-carried value lets XLA-GPU fuse the `where(active, new, old)` of
  each weight into the epilogue of the matmul that computes its gradient,
  where a flag computed from the step's inputs leaves a separate pass over the
  weights (`benchmarks/trainer_hlo.py --target h100`; docs/performance.md). A
  fully unrolled schedule (`_scan_unroll`: XLA-CPU's convolutions) has no loop,
  and computes the flag from the batch: XLA-CPU compiles that faster (1.1
  against 1.5 s for the FedAvg CNN's ten steps).

  Example:
    >>> first, following = _carried_flags(jnp.array([True, True, False]))
    >>> first.item(), following.tolist()
    (True, [True, False, True])
  """
  return active[0], jnp.roll(active, -1, axis=0)


class ClientResult(NamedTuple):
  """Output of one client's local training."""
  params: types.Tree
  opt_state: Any
  loss: chex.Array


def train_client(loss_fn: LossFn, optimizer: optax.GradientTransformation,
                 params: types.Tree, opt_state: Any, context: Any,
                 x: chex.Array, y: chex.Array, valid: chex.Array,
                 key: chex.PRNGKey, *, epochs: int, batch_size: int,
                 unroll: int | bool | None = None, remat: bool = False) -> ClientResult:
  """Trains one client for `epochs` local epochs (unstacked inputs).

  Returns the trained parameters and optimizer state, and the mean training loss
  over the client's real steps. `unroll` is as in `make_trainer`; `remat`
  wraps each local step in `jax.checkpoint`, so reverse-mode differentiation
  through the training (`pflax.tune`) keeps each step's parameters and optimizer
  state, not its activations (same results).
  """
  index, real, keys = _client_schedule(valid, key, epochs=epochs, batch_size=batch_size)
  grad_fn = jax.value_and_grad(loss_fn)

  first_batch = Batch(x[index[0]], y[index[0]], real[0])
  convolutional = lambda: _has_convolution(grad_fn, params, context, first_batch, keys[0])
  scan_unroll = _scan_unroll(unroll, index.shape[0], convolutional)
  unrolled = _fully_unrolled(scan_unroll, index.shape[0])

  def step(carry, inputs):
    params, opt_state, carried = carry
    idx, mask, k, next_active = inputs
    active = jnp.any(mask) if unrolled else carried
    loss, grads = grad_fn(params, context, Batch(x[idx], y[idx], mask), k)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(active, a, b), new, old)
    carry = (keep(new_params, params), keep(new_opt_state, opt_state), next_active)
    return carry, jnp.where(active, loss, 0.0)

  active = jnp.any(real, axis=-1)
  first, following = _carried_flags(active)
  (params, opt_state, _), losses = jax.lax.scan(
      jax.checkpoint(step) if remat else step, (params, opt_state, first),
      (index, real, keys, following), unroll=scan_unroll)
  mean_loss = jnp.sum(losses) / jnp.maximum(jnp.sum(active), 1)
  return ClientResult(params, opt_state, mean_loss)


PRECISIONS = ("float32", "bf16")
"""Compute precisions of local training (`with_precision`)."""


def _to_bf16(a: chex.Array) -> chex.Array:
  return a.astype(jnp.bfloat16) if jnp.issubdtype(a.dtype, jnp.floating) else a


def with_precision(loss_fn: LossFn, precision: str) -> LossFn:
  """`loss_fn` computing in `precision`, its parameters and gradients float32.

  "float32" returns `loss_fn` itself. "bf16" (mixed precision): the loss sees
  the floating leaves of the parameters and the inputs `batch.x` cast to
  bfloat16, so the model's activations and matmuls run in bfloat16, and
  returns a float32 loss. The parameters and the optimizer state stay float32:
  the cast's transpose turns the gradients back to float32, and the optimizer
  updates float32 weights. The `context` (e.g. FedProx's global model) is not
  cast. pflax's losses take the softmax in float32 (`losses.cross_entropy`).

  Raises:
    ValueError: for a precision not in `PRECISIONS`.
  """
  if precision not in PRECISIONS:
    raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}.")
  if precision == "float32":
    return loss_fn

  def bf16_loss(params, context, batch, key):
    low = batch._replace(x=jax.tree.map(_to_bf16, batch.x))
    return loss_fn(jax.tree.map(_to_bf16, params), context, low, key).astype(jnp.float32)
  return bf16_loss


def _stepwise(loss_fn: LossFn, optimizer: optax.GradientTransformation, *, epochs: int,
              batch_size: int, unroll: int | bool | None = None
              ) -> Callable[..., ClientResult]:
  """All clients' local training as one scan over steps of the vmapped step.

  The stacked form of `train_client` (same schedule, keys and arithmetic per
  client; results equal its vmap): every client's schedule is drawn first,
  its batches are gathered once before the loop into `(E * S, M, B, ...)`, and
  a `lax.scan` over the E * S steps applies `jax.vmap` of the step, the
  layout of a plain vmap of `jax.grad` over pre-batched data. Inside the
  vmapped `train_client` each step instead gathers every client's batch by
  its own indices (two batched gathers and an index concatenation per step,
  where this program slices one step of the laid-out batches). The batches
  take `E * ceil(L / B) * B / L` times the memory of `x`.
  """
  grad_fn = jax.vmap(jax.value_and_grad(loss_fn))
  update = jax.vmap(optimizer.update)

  def keep(active, new, old):
    where = lambda a, b: jnp.where(active.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)
    return jax.tree.map(where, new, old)

  def step(carry, inputs, unrolled):
    params, opt_state, carried = carry
    batch, k, next_active, context = inputs
    active = jnp.any(batch.mask, axis=-1) if unrolled else carried
    loss, grads = grad_fn(params, context, batch, k)
    updates, new_opt_state = update(grads, opt_state, params)
    new = (optax.apply_updates(params, updates), new_opt_state)
    carry = (*keep(active, new, (params, opt_state)), next_active)
    return carry, jnp.where(active, loss, 0.0)

  def train(params, opt_state, context, x, y, valid, keys):
    schedule = functools.partial(_client_schedule, epochs=epochs, batch_size=batch_size)
    index, real, step_keys = jax.vmap(schedule)(valid, keys)
    take = jax.vmap(lambda a, i: a[i])  # (M, L, ...) by (M, E*S, B) -> (M, E*S, B, ...)
    steps_first = lambda a: jnp.moveaxis(a, 1, 0)
    batches = Batch(steps_first(take(x, index)), steps_first(take(y, index)),
                    steps_first(real))
    first_client = lambda tree: jax.tree.map(lambda a: a[0], tree)
    convolutional = lambda: _has_convolution(
        loss_fn, first_client(params), first_client(context),
        first_client(first_client(batches)), step_keys[0, 0])
    scan_unroll = _scan_unroll(unroll, index.shape[1], convolutional)
    unrolled = _fully_unrolled(scan_unroll, index.shape[1])
    body = lambda carry, inputs: step(carry, (*inputs, context), unrolled)
    active = jnp.any(batches.mask, axis=-1)
    first, following = _carried_flags(active)
    (params, opt_state, _), losses = jax.lax.scan(
        body, (params, opt_state, first), (batches, steps_first(step_keys), following),
        unroll=scan_unroll)
    losses, active = losses.T, active.T  # (M, E * S), the reductions of the vmap
    mean_loss = jnp.sum(losses, axis=1) / jnp.maximum(jnp.sum(active, axis=1), 1)
    return ClientResult(params, opt_state, mean_loss)

  return train


TRAINER_STRATEGIES = mapping.STRATEGIES + ("steps",)
"""`make_trainer`'s strategies: `pflax.train.STRATEGIES` and "steps" (`_stepwise`)."""


def make_trainer(loss_fn: LossFn, optimizer: optax.GradientTransformation, *,
                 epochs: int, batch_size: int, strategy: str = "auto",
                 unroll: int | bool | None = None, chunk_size: int | None = None,
                 memory_budget: int | None = None, threads: int | None = None,
                 precision: str = "float32") -> Callable[..., ClientResult]:
  """Builds the local-training function of a round; build once, call every round.

  Args:
    loss_fn: `loss_fn(params, context, batch, key) -> scalar` for one client.
    optimizer: an optax optimizer, one state per client.
    epochs: local epochs E.
    batch_size: mini-batch size B.
    strategy: how clients are mapped: "auto" (vmap on accelerators, loop on
      CPU), "vmap", "loop" or "map" (`map_clients`), or "steps": one scan
      over the local steps of all clients, batches laid out before it (the
      layout of a plain vmap of `jax.grad`; see `_stepwise`), in chunks of
      `chunk_size` clients if given. Every strategy gives the same results;
      "steps" gives bit for bit those of "vmap" on CPU.
    unroll: `lax.scan` unroll factor over the E * S local steps; True
      unrolls all of them. None (default) unrolls all of them on XLA-CPU when
      E * S <= 64 and the step computes a convolution (`_has_convolution`),
      and otherwise keeps a rolled loop. XLA-CPU canonicalises convolutions
      for its fast kernels only outside loops, so with any loop left in the
      schedule (even 8-fold unrolled) the backward convolutions of the FedAvg
      CNN take a generic path: 73 against 12.5 ms per step of 10 samples.
      Unrolling costs compile time, about 0.18 s per step, and speeds up only
      convolutions: the digits MLP's 35 steps compiled in 5.5 s unrolled and
      1.4 s rolled, and ran 51 against 32 ms per round of 20 clients.
    chunk_size: clients per chunk for the "map" and "steps" strategies.
    memory_budget: bytes for the clients training at once, for strategies
      "map" and "auto" instead of `chunk_size`: at the first call with new
      shapes, one client's memory is measured (`bytes_per_client`, one extra
      compilation) and the chunk size taken from `chunk_size_for_budget`.
      "auto" keeps "vmap" while all clients fit the budget and chunks them
      otherwise; where it resolves to "loop" (CPU) one client per worker
      thread trains at a time and the budget is not consulted. None
      (default): no budget.
    threads: worker threads of the "loop" strategy (None: one per CPU core
      available, `default_threads()`).
    precision: "float32" or "bf16", bfloat16 activations and matmuls with
      float32 parameters and optimizer state (`with_precision`).

  Returns:
    `train(params, opt_state, context, x, y, valid, keys) -> ClientResult`, all
    arguments stacked over clients (`keys`: `(M, ...)` PRNG keys). The result
    equals training each client alone with `train_client`.
  """
  if epochs < 1 or batch_size < 1:
    raise ValueError(f"epochs and batch_size must be >= 1, got {epochs}, {batch_size}.")
  mapping.check_threads(threads)
  loss_fn = with_precision(loss_fn, precision)
  if strategy == "steps":
    if memory_budget is not None:
      raise ValueError("memory_budget needs strategy 'auto' or 'map', got 'steps'; "
                       "give chunk_size instead.")
    stepwise = _stepwise(loss_fn, optimizer, epochs=epochs, batch_size=batch_size,
                         unroll=unroll)
    if chunk_size is None:
      return jax.jit(stepwise)
    return jax.jit(functools.partial(mapping.map_chunks, jax.jit(stepwise), chunk_size))
  if strategy not in TRAINER_STRATEGIES:
    raise ValueError(f"strategy must be one of {TRAINER_STRATEGIES}, got {strategy!r}.")
  one = functools.partial(train_client, loss_fn, optimizer, epochs=epochs,
                          batch_size=batch_size, unroll=unroll)
  if memory_budget is None:
    return mapping.map_clients(one, strategy, chunk_size, threads)
  if strategy not in ("auto", "map") or chunk_size is not None:
    raise ValueError("memory_budget needs strategy 'auto' or 'map' and no chunk_size, "
                     f"got {strategy!r} and {chunk_size}.")
  return mapping.within_budget(one, mapping.resolve_strategy(strategy), memory_budget,
                               threads)


def init_opt_state(optimizer: optax.GradientTransformation,
                   params: types.Stacked) -> Any:
  """Stacked optimizer state: one per client."""
  return jax.vmap(optimizer.init)(params)


def evaluate_client(apply_fn: Callable[[types.Tree, chex.Array], chex.Array],
                    params: types.Tree, x: chex.Array, y: chex.Array,
                    valid: chex.Array, batch_size: int = 256) -> chex.Array:
  """Number of correctly classified valid samples of one client (int32).

  Batches of at most `batch_size` samples (fewer for a short test split, which
  is then not padded to a full batch).
  """
  length = x.shape[0]
  batch_size = max(1, min(batch_size, length))
  steps = _num_steps(length, batch_size)
  pad = steps * batch_size - length
  xs = jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)).reshape(
      (steps, batch_size) + x.shape[1:])
  ys = jnp.pad(y, (0, pad)).reshape(steps, batch_size)
  vs = jnp.pad(valid, (0, pad)).reshape(steps, batch_size)

  def count(total, batch):
    bx, by, bv = batch
    hit = (jnp.argmax(apply_fn(params, bx), axis=-1) == by) & bv
    return total + jnp.sum(hit, dtype=jnp.int32), None

  return jax.lax.scan(count, jnp.zeros((), jnp.int32), (xs, ys, vs))[0]
